"""The KV listener's app (:mod:`flowprefill.prefill.server.kv_http`): which ``Range`` requests it
serves, and that every refusal is an OpenAI-style JSON error (Starlette's own answers to
a bad range are plain text)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from flowprefill.kv import SharedDirTransport
from flowprefill.prefill.server.kv_http import create_kv_app


@pytest.mark.parametrize(
    ("range_header", "status"),
    [
        ("bytes=0-7", 206),
        ("bytes=8-", 206),
        ("bytes=-8", 206),
        ("bytes=0-999999", 206),  # past the end: up to the end
        ("bytes=5-2", 400),
        ("bytes=", 400),
        ("bytes=0-1,4-5", 400),  # decode asks for one range; several are not served
        ("items=0-7", 400),
        ("bytes=+1-7", 400),  # what Python's int() would take
        ("bytes=" + "9" * 30 + "-", 400),
        ("bytes=100-", 416),
        ("bytes=-0", 416),
    ],
)
def test_range_requests_get_the_bytes_or_a_json_error(
    tmp_path: Path, range_header: str, status: int
) -> None:
    store = SharedDirTransport(tmp_path)
    store.root.mkdir(parents=True, exist_ok=True)
    data = bytes(range(100))
    store.path("h").write_bytes(data)
    client = TestClient(create_kv_app(store))
    r = client.get("/v1/kv/h", headers={"Range": range_header})
    assert r.status_code == status, r.text
    if status == 206:
        first, last = range_header.removeprefix("bytes=").split("-")
        start = int(first) if first else len(data) - int(last)
        end = min(int(last) + 1, len(data)) if first and last else len(data)
        assert r.content == data[start:end]
    else:
        error = r.json()["error"]
        assert error["param"] == "range" and range_header[:20] in error["message"]
        if status == 416:
            assert r.headers["content-range"] == "bytes */100"
