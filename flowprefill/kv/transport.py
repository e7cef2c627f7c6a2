"""Where hand-offs live between the prefill instance and a decode instance.

A transport stores and fetches :class:`~flowprefill.kv.format.KVHandoff` objects by a
*hand-off id* (the gateway passes the id to decode in ``kv_transfer_params``). The only
implementation here is :class:`SharedDirTransport`: a directory both processes see (one
machine, or a shared volume in a pod). A network transport (HTTP pull from the prefill
instance, NIXL/RDMA, an object store) implements the same four methods; the connector only
calls ``header()``/``open()`` on the decode side and the prefill side only calls ``put()``,
so adding one touches neither the format nor the connector's scheduling logic. A transport
is chosen by name from the connector's ``kv_connector_extra_config`` (``transport``).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Protocol

from flowprefill.kv.errors import KVHandoffError, KVNotFoundError
from flowprefill.kv.format import KVHandoff, KVHeader, KVReader, write_handoff

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
SUFFIX = ".kv.safetensors"
KV_DIR_ENV = "FLOWPREFILL_KV_DIR"
DEFAULT_KV_DIR = "/tmp/flowprefill-kv"


def default_storage_path() -> str:
    """``$FLOWPREFILL_KV_DIR`` or /tmp/flowprefill-kv: what producer and consumer share when
    neither is configured explicitly (one machine, or one volume mounted at that path)."""
    return os.environ.get(KV_DIR_ENV) or DEFAULT_KV_DIR


def check_handoff_id(handoff_id: str) -> str:
    """Ids become file names: allow only a safe alphabet (no path traversal, no dot-files)."""
    if not isinstance(handoff_id, str) or not _ID_RE.match(handoff_id) or ".." in handoff_id:
        raise KVHandoffError(
            f"invalid hand-off id {handoff_id!r}: use 1-128 of [A-Za-z0-9_.-], not starting "
            "with '.' or '-' and without '..'"
        )
    return handoff_id


class KVTransport(Protocol):
    """Stores hand-offs by id. Implementations must make ``put`` atomic: a reader sees
    either no hand-off or a complete one, never a partial write."""

    def put(self, handoff_id: str, handoff: KVHandoff) -> None: ...

    def open(self, handoff_id: str) -> KVReader: ...

    def header(self, handoff_id: str) -> KVHeader: ...

    def delete(self, handoff_id: str) -> bool: ...


class SharedDirTransport:
    """Hand-offs as ``<root>/<id>.kv.safetensors``, written atomically (temp file + rename).

    Orphans (a client that went away before decode) are removed by :meth:`sweep`; the
    connector deletes a hand-off when its request finishes if ``delete_after_load`` is set.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, handoff_id: str) -> Path:
        return self.root / f"{check_handoff_id(handoff_id)}{SUFFIX}"

    def put(self, handoff_id: str, handoff: KVHandoff) -> None:
        final = self.path(handoff_id)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        try:
            write_handoff(handoff, tmp)
            os.replace(tmp, final)  # atomic on POSIX within one filesystem
        finally:
            tmp.unlink(missing_ok=True)

    def open(self, handoff_id: str) -> KVReader:
        path = self.path(handoff_id)
        if not path.is_file():
            raise KVNotFoundError(f"no KV hand-off {handoff_id!r} in {self.root}")
        return KVReader(path)

    def header(self, handoff_id: str) -> KVHeader:
        with self.open(handoff_id) as reader:
            return reader.header

    def delete(self, handoff_id: str) -> bool:
        try:
            self.path(handoff_id).unlink()
        except FileNotFoundError:
            return False
        return True

    def sweep(self, max_age_s: float, now_s: float | None = None) -> int:
        """Delete hand-offs older than ``max_age_s`` (by mtime); returns how many."""
        cutoff = (time.time() if now_s is None else now_s) - max_age_s
        removed = 0
        for path in self.root.glob(f"*{SUFFIX}"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # consumed concurrently
                continue
        return removed


def make_transport(name: str, **options: object) -> KVTransport:
    """A transport by name; today only ``shared_dir`` (option ``path``, default
    :func:`default_storage_path`)."""
    if name == "shared_dir":
        path = options.get("path") or default_storage_path()
        if not isinstance(path, str | os.PathLike):
            raise KVHandoffError("shared_dir transport needs a 'path' option")
        return SharedDirTransport(path)
    raise KVHandoffError(f"unknown KV transport {name!r}; expected one of: shared_dir")
