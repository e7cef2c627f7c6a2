"""uvicorn's access log line, formatted without copying the record twice.

uvicorn writes one access line per request, on the way to the first byte of the answer
(``http.response.start``). Its :class:`uvicorn.logging.AccessFormatter` copies the
``LogRecord`` (``copy.copy``) to add the request line and status, then its base class
copies it again to add the level prefix — about half the cost of the line. For the
uncoloured case (output not a terminal: a file, a pipe, a container log),
:class:`AccessFormatter` computes the same fields into one plain ``dict`` and applies the
same format string to it: the line is the same, character for character, and the record
is not changed (as uvicorn leaves it). Coloured output (a terminal) is uvicorn's own path.

Nothing is added to what the line carries — client address, method, path with query,
HTTP version, status — so the log-privacy guarantees stay as they are.
"""

from __future__ import annotations

import copy
import http
import logging
from typing import Any

import uvicorn.config
import uvicorn.logging


def _status_and_phrase(status_code: int) -> str:
    try:
        phrase = http.HTTPStatus(status_code).phrase
    except ValueError:
        phrase = ""
    return f"{status_code} {phrase}"


_STATUS = {code: _status_and_phrase(code) for code in range(100, 600)}
"""``"200 OK"`` and the like, as uvicorn's ``get_status_code`` builds them uncoloured."""


class AccessFormatter(uvicorn.logging.AccessFormatter):
    """uvicorn's access formatter, same output, one dict instead of two record copies."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        if self.use_colors:
            return super().formatMessage(record)
        client_addr, method, full_path, http_version, status_code = record.args  # type: ignore[misc]
        code = int(status_code)  # type: ignore[arg-type]
        status = _STATUS.get(code)
        values: dict[str, Any] = dict(record.__dict__)
        values["client_addr"] = client_addr
        values["request_line"] = f"{method} {full_path} HTTP/{http_version}"
        values["status_code"] = status if status is not None else _status_and_phrase(code)
        levelname = record.levelname
        values["levelprefix"] = levelname + ":" + " " * (8 - len(levelname))
        style = self._style
        defaults = style._defaults  # type: ignore[attr-defined]
        if defaults:
            values = {**defaults, **values}
        try:
            return style._fmt % values
        except KeyError as e:  # as logging.PercentStyle.format reports it
            raise ValueError(f"Formatting field not found in record: {e}") from None


def log_config() -> dict[str, Any]:
    """uvicorn's default logging configuration with :class:`AccessFormatter` for access
    lines (``uvicorn.run(..., log_config=log_config())``)."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["formatters"]["access"]["()"] = f"{__name__}.AccessFormatter"
    return config
