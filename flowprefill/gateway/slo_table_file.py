"""The SLO table file a gateway serves, re-read when it changes."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pydantic import ValidationError

from flowprefill.contracts import SLOTable
from flowprefill.errors import InvalidRequestError

log = logging.getLogger(__name__)


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
