"""Which SLO class a request belongs to, from the SLO table the operator maintains.

Order (documented in :class:`flowprefill.contracts.SLOTable`):

1. an ``x-slo-class`` header, else a ``slo_class`` body field, naming a known class;
2. the first class (table order: most urgent first) whose non-empty rules all match —
   headers (all listed must match), model name, path prefix, API key hash;
3. the default class.

A header or field naming an unknown class falls through to 2–3 and is reported back
(``x-flowprefill-slo-class-fallback``) instead of failing the request.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from flowprefill.contracts import SLOTable, SLOTableClass
from flowprefill.contracts.deployment import SLO_CLASS_HEADER
from flowprefill.errors import InvalidRequestError

log = logging.getLogger(__name__)

SLO_CLASS_FIELD = "slo_class"

Source = Literal["header", "field", "rule", "default"]


@dataclass(frozen=True, slots=True)
class Classification:
    slo_class: SLOTableClass
    source: Source
    unknown_requested: str | None = None
    """A class name the client asked for that the table does not have."""


def api_key_hash(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    return hashlib.sha256(token.strip().encode()).hexdigest()


def classify(
    table: SLOTable,
    *,
    headers: Mapping[str, str],
    body_class: str | None,
    model: str | None,
    path: str,
) -> Classification:
    """``headers`` must be case-insensitive (Starlette's are) or lower-cased."""
    by_name = {c.name: c for c in table.classes}
    unknown: str | None = None
    for source, name in (("header", headers.get(SLO_CLASS_HEADER)), ("field", body_class)):
        if name:
            if name in by_name:
                return Classification(by_name[name], source)  # type: ignore[arg-type]
            unknown = unknown or name
    key_hash = api_key_hash(headers.get("authorization"))
    for c in table.classes:
        m = c.match
        if not (m.headers or m.models or m.paths or m.api_key_hashes):
            continue
        if m.headers and any(headers.get(k) != v for k, v in m.headers.items()):
            continue
        if m.models and model not in m.models:
            continue
        if m.paths and not any(path.startswith(p) for p in m.paths):
            continue
        if m.api_key_hashes and key_hash not in m.api_key_hashes:
            continue
        return Classification(c, "rule", unknown)
    if table.default_class is None:
        what = f"unknown SLO class {unknown!r}" if unknown else "no SLO class matches"
        raise InvalidRequestError(f"{what} and the SLO table has no default class")
    return Classification(by_name[table.default_class], "default", unknown)


class SLOTableFile:
    """The SLO table file, re-read when it changes (ConfigMap updates swap a symlink).

    :meth:`refresh` is cheap (one ``stat``) and is called by the gateway's background
    watcher; a file that fails to parse keeps the last good table and logs why.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self.table = self._read()
        self.num_reloads = 0

    def _stat(self) -> tuple[int, int, int]:
        st = self.path.stat()  # follows symlinks: a swapped ConfigMap target changes inode
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _read(self) -> SLOTable:
        stamp = self._stat()
        try:
            table = SLOTable.model_validate_json(self.path.read_bytes())
        except ValidationError as e:
            raise InvalidRequestError(f"SLO table {self.path} is invalid: {e}") from None
        self._stamp = stamp
        return table

    def refresh(self) -> bool:
        """Reload if the file changed; True when a new table was loaded."""
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return False
            self._stamp = stamp  # a bad file is reported once, not at every refresh
            self.table = self._read()
        except (OSError, InvalidRequestError) as e:
            log.warning("keeping the previous SLO table: %s", e)
            return False
        self.num_reloads += 1
        log.info("reloaded SLO table %s (%d classes)", self.path, len(self.table.classes))
        return True
