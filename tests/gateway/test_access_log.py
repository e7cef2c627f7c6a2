"""The gateway's access formatter writes uvicorn's access line, character for character."""

from __future__ import annotations

import io
import logging
import logging.config

import pytest
import uvicorn.config
import uvicorn.logging

from flowprefill.gateway.access_log import AccessFormatter, log_config

FMT = uvicorn.config.LOGGING_CONFIG["formatters"]["access"]["fmt"]


def record(
    status: int, *, level: int = logging.INFO, path: str = "/v1/completions"
) -> logging.LogRecord:
    # As uvicorn's httptools protocol logs it: '%s - "%s %s HTTP/%s" %d'.
    return logging.LogRecord(
        "uvicorn.access",
        level,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:52814", "POST", path, "1.1", status),
        None,
    )


@pytest.mark.parametrize("status", [200, 204, 400, 404, 413, 422, 499, 503, 599, 700])
@pytest.mark.parametrize("level", [logging.INFO, logging.WARNING, logging.CRITICAL])
def test_same_line_as_uvicorn(status: int, level: int) -> None:
    ours = AccessFormatter(FMT, use_colors=False)
    theirs = uvicorn.logging.AccessFormatter(FMT, use_colors=False)
    r = record(status, level=level, path="/v1/completions?x=%20y")
    before = dict(r.__dict__)
    assert ours.format(r) == theirs.format(
        record(status, level=level, path="/v1/completions?x=%20y")
    )
    assert {k: v for k, v in r.__dict__.items() if k != "message"} == {
        k: v for k, v in before.items() if k != "message"
    }  # the record is left as uvicorn leaves it (format() itself sets ``message``)


def test_other_formats_and_defaults() -> None:
    fmt = "%(asctime)s %(levelprefix)s|%(client_addr)s|%(request_line)s|%(status_code)s|%(tag)s"
    ours = AccessFormatter(fmt, use_colors=False)
    theirs = uvicorn.logging.AccessFormatter(fmt, use_colors=False)
    for formatter in (ours, theirs):
        formatter._style._defaults = {"tag": "gw"}  # type: ignore[attr-defined]
    r = record(200)  # one record for both: the same asctime
    assert ours.format(r) == theirs.format(r)
    assert ours.format(r).endswith("|gw")
    ours._style._fmt = "%(nope)s"
    with pytest.raises(ValueError, match="Formatting field not found"):
        ours.format(record(200))


def test_coloured_output_is_uvicorns() -> None:
    assert AccessFormatter(FMT, use_colors=True).format(record(200)) == (
        uvicorn.logging.AccessFormatter(FMT, use_colors=True).format(record(200))
    )


def test_log_config_is_uvicorns_with_the_formatter(monkeypatch: pytest.MonkeyPatch) -> None:
    config = log_config()
    expected = uvicorn.config.LOGGING_CONFIG
    assert config["formatters"]["access"]["()"] == "flowprefill.gateway.access_log.AccessFormatter"
    config["formatters"]["access"]["()"] = expected["formatters"]["access"]["()"]
    assert config == expected  # nothing else differs, and uvicorn's own dict is untouched
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    saved = {
        name: (logger.handlers[:], logger.level, logger.propagate)
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        for logger in [logging.getLogger(name)]
    }
    logging.config.dictConfig(log_config())
    try:
        args = record(200).args
        assert isinstance(args, tuple)
        logging.getLogger("uvicorn.access").info(record(200).msg, *args)
        assert (
            out.getvalue() == 'INFO:     127.0.0.1:52814 - "POST /v1/completions HTTP/1.1" 200 OK\n'
        )
    finally:
        for name, (handlers, level, propagate) in saved.items():
            logger = logging.getLogger(name)
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate
