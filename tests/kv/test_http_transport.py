"""The ``http`` KV transport against the real prefill server: pull, failures, clean-up.

The prefill side is the real app (``create_app`` with a real tiny-model engine) serving
its own hand-off directory; decode's side is :class:`HTTPPullTransport` with a different
local cache directory. Misbehaving peers (a connection cut mid-body, a server that never
answers) are raw sockets: the real server cannot be made to do that.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from flowprefill.contracts.deployment import KV_ADVERTISE_URL_ENV as ADVERTISE_URL_ENV
from flowprefill.contracts.kv import HandoffRef, check_source_url, kv_transfer_config
from flowprefill.errors import KVFormatError, KVHandoffError, KVNotFoundError
from flowprefill.kv import (
    HTTPPullTransport,
    SharedDirTransport,
    make_transport,
)
from flowprefill.models import build_named
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.server.kv_http import create_kv_app
from flowprefill.prefill.server.kv_sink import advertise_url, directory_sink
from flowprefill.prefill.server.prefill import create_app
from tests.helpers import serve_in_thread


@pytest.fixture(scope="module")
def executor() -> Iterator[PreemptibleExecutor]:
    model = build_named("tiny-llama", seed=0)
    with PreemptibleExecutor(model, granularity="operator") as ex:
        yield ex


@pytest.fixture
def prefill(executor: PreemptibleExecutor, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The real prefill server with ``--kv-transport http`` wiring: its main app, and its KV
    listener's app on a second port, which the hand-offs name as their source."""
    engine = PrefillEngine(executor, TTFTPredictor.linear(1e-5))
    sink = directory_sink(tmp_path / "prefill-kv", executor.model.config)
    with (
        serve_in_thread(create_kv_app(sink.transport)) as kv_url,
        serve_in_thread(
            create_app(engine, kv_sink=sink, kv_store=sink.transport, kv_url=kv_url)
        ) as url,
    ):
        sink.source = kv_url  # the port is known only once the server listens
        yield {"url": url, "kv_url": kv_url, "sink": sink, "store": sink.transport}


def ids(n: int, k: int = 7) -> list[int]:
    return [(k * i) % 2000 + 1 for i in range(n)]


def prefill_ref(prefill: dict[str, Any], rid: str, n: int = 50) -> HandoffRef:
    r = httpx.post(
        f"{prefill['url']}/v1/prefill",
        json={"request_id": rid, "prompt_token_ids": ids(n), "ttft_slo_s": 10.0},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    ref = HandoffRef.from_params(r.json()["kv_transfer_params"])
    assert ref is not None
    return ref


def pull(tmp_path: Path, **options: Any) -> HTTPPullTransport:
    return HTTPPullTransport(tmp_path / "decode-cache", **options)


def test_pulled_handoff_is_byte_identical_and_reads_the_same(
    prefill: dict[str, Any], executor: PreemptibleExecutor, tmp_path: Path
) -> None:
    ref = prefill_ref(prefill, "cmpl-1", 50)
    assert ref == HandoffRef("cmpl-1", 50, source=prefill["kv_url"])
    served = prefill["store"].path("cmpl-1")
    transport = pull(tmp_path)
    # Scheduler side: the header alone, by range request; nothing is stored locally.
    header = transport.header(ref)
    assert header == prefill["store"].header("cmpl-1")
    assert list(transport.root.iterdir()) == []
    # Worker side: one download into the local cache, then lazy reads from it.
    with transport.open(ref) as reader:
        handoff = reader.read_all()  # verifies the CRC-32 too
    local = transport.root / "cmpl-1.kv.safetensors"
    assert local.read_bytes() == served.read_bytes()
    assert transport.root != prefill["store"].root
    alone = executor.prefill([ids(50)])[0]
    assert handoff.token_ids == ids(50)
    for (k, v), (k2, v2) in zip(handoff.layers, alone.kv_cache, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert transport.header(ref) == header  # now from the local copy
    transport.close()


def test_header_fetch_reads_only_the_header(prefill: dict[str, Any], tmp_path: Path) -> None:
    ref = prefill_ref(prefill, "big", 400)
    size = prefill["store"].path("big").stat().st_size
    r = httpx.get(f"{ref.source}/v1/kv/big", headers={"Range": "bytes=0-65535"})
    assert r.status_code == 206 and r.headers["content-range"].endswith(f"/{size}")
    n = int.from_bytes(r.content[:8], "little")
    assert size > 65536 > 8 + n  # the whole header fits in the first probe
    assert httpx.get(f"{ref.source}/v1/kv/big").content == prefill["store"].path("big").read_bytes()
    head = httpx.head(f"{ref.source}/v1/kv/big")
    assert head.status_code == 200 and int(head.headers["content-length"]) == size
    assert head.content == b""
    # The gateway-facing port does not serve the bytes, whatever the request.
    for method in ("GET", "HEAD"):
        r = httpx.request(method, f"{prefill['url']}/v1/kv/big", headers={"Range": "bytes=0-9"})
        assert r.status_code == 405 and r.headers["allow"] == "DELETE"


def test_missing_handoff_is_404_and_not_found(prefill: dict[str, Any], tmp_path: Path) -> None:
    r = httpx.get(f"{prefill['kv_url']}/v1/kv/never-written")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and "never-written" in err["message"]
    transport = pull(tmp_path)
    ref = HandoffRef("never-written", source=prefill["kv_url"])
    with pytest.raises(KVNotFoundError, match=r"HTTP 404: no KV hand-off 'never-written'"):
        transport.header(ref)
    with pytest.raises(KVNotFoundError, match="HTTP 404"):
        transport.open(ref)
    assert list(transport.root.iterdir()) == []  # no partial file left behind


@pytest.mark.parametrize("bad", ["a..b", ".hidden", "-x", "x" * 129])
def test_bad_ids_are_refused_on_both_sides(
    prefill: dict[str, Any], tmp_path: Path, bad: str
) -> None:
    for url, method in [(prefill["kv_url"], "GET"), (prefill["kv_url"], "DELETE"),
                        (prefill["url"], "DELETE")]:  # fmt: skip
        r = httpx.request(method, f"{url}/v1/kv/{bad}")
        assert r.status_code == 400, r.text
        assert "invalid hand-off id" in r.json()["error"]["message"]
    with pytest.raises(KVHandoffError, match="invalid hand-off id"):
        pull(tmp_path).header(HandoffRef(bad, source=prefill["kv_url"]))


def test_ref_without_source_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KVHandoffError, match="no source URL"):
        pull(tmp_path).header(HandoffRef("a"))


def test_truncated_file_on_the_server_is_a_format_error(
    prefill: dict[str, Any], tmp_path: Path
) -> None:
    ref = prefill_ref(prefill, "whole", 60)
    data = prefill["store"].path("whole").read_bytes()
    prefill["store"].path("cut").write_bytes(data[: len(data) - 100])
    transport = pull(tmp_path)
    cut = HandoffRef("cut", source=ref.source)
    assert transport.header(cut) == transport.header(ref)  # the header itself is intact
    with pytest.raises(KVFormatError, match=rf"truncated hand-off: {len(data) - 100} bytes"):
        transport.open(cut)
    assert list(transport.root.iterdir()) == []


def test_oversized_handoff_is_refused(prefill: dict[str, Any], tmp_path: Path) -> None:
    ref = prefill_ref(prefill, "large", 60)
    size = prefill["store"].path("large").stat().st_size
    transport = pull(tmp_path, max_bytes=size - 1)
    with pytest.raises(KVHandoffError, match="exceeds max_bytes"):
        transport.header(ref)
    with pytest.raises(KVHandoffError, match="exceeds max_bytes"):
        transport.open(ref)
    assert list(transport.root.iterdir()) == []


def test_delete_removes_both_copies(prefill: dict[str, Any], tmp_path: Path) -> None:
    ref = prefill_ref(prefill, "done", 30)
    transport = pull(tmp_path)
    transport.open(ref).close()
    local, served = transport.root / "done.kv.safetensors", prefill["store"].path("done")
    assert local.is_file() and served.is_file()
    assert transport.delete(ref, wait=True)
    assert not local.exists() and not served.exists()
    r = httpx.delete(f"{ref.source}/v1/kv/done")
    assert r.status_code == 404  # already gone
    # discard: the local copy only
    ref2 = prefill_ref(prefill, "kept", 30)
    transport.open(ref2).close()
    transport.discard(ref2)
    assert not (transport.root / "kept.kv.safetensors").exists()
    assert prefill["store"].path("kept").is_file()
    transport.close()


def test_prefill_sweeps_served_handoffs(prefill: dict[str, Any], tmp_path: Path) -> None:
    import os

    prefill_ref(prefill, "old", 20)
    os.utime(prefill["store"].path("old"), (1000.0, 1000.0))
    prefill["sink"].max_age_s = 60.0
    prefill["sink"]._last_sweep = 0.0
    ref = prefill_ref(prefill, "new", 20)
    with pytest.raises(KVNotFoundError):
        pull(tmp_path).header(HandoffRef("old", source=ref.source))
    assert pull(tmp_path).header(ref).num_tokens == 20


# ----------------------------------------------------------- misbehaving peers


@contextmanager
def raw_server(handle: Callable[[socket.socket], None]) -> Iterator[str]:
    """A TCP server on loopback; ``handle`` gets each accepted connection."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    stop = threading.Event()
    conns: list[socket.socket] = []

    def serve() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            conns.append(conn)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for conn in conns:
            conn.close()
        sock.close()


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_connection_cut_mid_body_is_a_clear_error(prefill: dict[str, Any], tmp_path: Path) -> None:
    prefill_ref(prefill, "src", 60)
    data = prefill["store"].path("src").read_bytes()

    def cut(conn: socket.socket) -> None:
        _read_request(conn)
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data[: len(data) // 2]
        )
        conn.close()

    with raw_server(cut) as url:
        transport = pull(tmp_path)
        with pytest.raises(KVHandoffError, match=r"GET .*/v1/kv/src failed: RemoteProtocolError"):
            transport.open(HandoffRef("src", source=url))
    assert list(transport.root.iterdir()) == []


def test_stalled_server_times_out(tmp_path: Path) -> None:
    def stall(conn: socket.socket) -> None:
        _read_request(conn)
        time.sleep(10)  # never answers

    with raw_server(stall) as url:
        transport = pull(tmp_path, timeout_s=0.5, header_timeout_s=0.3)
        ref = HandoffRef("slow", source=url)
        t0 = time.monotonic()
        with pytest.raises(KVHandoffError, match=r"no response within 0\.3 s \(ReadTimeout\)"):
            transport.header(ref)
        assert time.monotonic() - t0 < 3
        t0 = time.monotonic()
        with pytest.raises(KVHandoffError, match=r"no response within 0\.5 s"):
            transport.open(ref)
        assert time.monotonic() - t0 < 3


def test_server_stalling_mid_body_times_out(prefill: dict[str, Any], tmp_path: Path) -> None:
    prefill_ref(prefill, "src", 60)
    data = prefill["store"].path("src").read_bytes()

    def stall_mid_body(conn: socket.socket) -> None:
        _read_request(conn)
        conn.sendall(
            f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data[:1000]
        )
        time.sleep(10)

    with raw_server(stall_mid_body) as url:
        transport = pull(tmp_path, timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(KVHandoffError, match=r"no response within 0\.5 s"):
            transport.open(HandoffRef("src", source=url))
        assert time.monotonic() - t0 < 3
    assert list(transport.root.iterdir()) == []


def test_trickling_server_hits_the_download_deadline(
    prefill: dict[str, Any], tmp_path: Path
) -> None:
    prefill_ref(prefill, "src", 60)
    data = prefill["store"].path("src").read_bytes()

    def trickle(conn: socket.socket) -> None:
        _read_request(conn)
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\n\r\n".encode())
        try:
            for i in range(0, len(data), 100):
                conn.sendall(data[i : i + 100])
                time.sleep(0.05)
        except OSError:
            pass

    with raw_server(trickle) as url:
        transport = pull(tmp_path, timeout_s=0.5, max_download_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(KVHandoffError, match="took longer than 1 s"):
            transport.open(HandoffRef("src", source=url))
        assert time.monotonic() - t0 < 3


def test_refused_connection(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(KVHandoffError, match="failed: ConnectError"):
        pull(tmp_path).header(HandoffRef("x", source=f"http://127.0.0.1:{port}"))


# ------------------------------------------------------------ parameters, wiring


def test_source_is_in_params_only_when_set() -> None:
    assert "source" not in HandoffRef("a", 3).to_params()["flowprefill"]
    ref = HandoffRef("a", 3, source="http://10.0.0.7:8100/")
    assert ref.source == "http://10.0.0.7:8100"
    params = ref.to_params()
    assert params["flowprefill"]["source"] == "http://10.0.0.7:8100"
    assert HandoffRef.from_params(params) == ref


@pytest.mark.parametrize(
    "bad",
    [
        "ftp://h/x",
        "10.0.0.7:8100",
        "http://",
        "http://h:99999",
        "http://u:p@h",
        "http://h/?a=1",
        "http://h/#x",
        "http://h /x",
        "",
    ],
)
def test_bad_source_urls_are_refused(bad: str) -> None:
    with pytest.raises(KVHandoffError, match="source"):
        check_source_url(bad)
    with pytest.raises(KVHandoffError):
        HandoffRef.from_params({"flowprefill": {"handoff_id": "a", "source": bad}})
    with pytest.raises(KVHandoffError, match="URL string"):
        HandoffRef.from_params({"flowprefill": {"handoff_id": "a", "source": 5}})


def test_shared_dir_transport_takes_refs(tmp_path: Path) -> None:
    from tests.kv.test_format import make_handoff

    store = SharedDirTransport(tmp_path)
    store.put("r", make_handoff())
    assert store.header(HandoffRef("r")) == store.header("r")
    store.discard(HandoffRef("r"))  # the consumer keeps no copy: nothing removed
    assert store.delete(HandoffRef("r")) and not store.path("r").exists()


def test_make_transport_http(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_transport(
        "http", cache_dir=str(tmp_path / "c"), timeout_s=2, header_timeout_s=0.5, max_bytes=10
    )
    assert isinstance(t, HTTPPullTransport)
    assert (t.root, t.timeout_s, t.header_timeout_s, t.max_bytes) == (tmp_path / "c", 2, 0.5, 10)
    monkeypatch.setenv("FLOWPREFILL_KV_CACHE_DIR", str(tmp_path / "env"))
    env = make_transport("http")
    assert isinstance(env, HTTPPullTransport) and env.root == tmp_path / "env"
    with pytest.raises(KVHandoffError, match="timeout_s must be a number"):
        make_transport("http", timeout_s="soon")
    extra = kv_transfer_config("/cache", transport="http")["kv_connector_extra_config"]
    assert extra == {"transport": "http", "cache_dir": "/cache"}
    with pytest.raises(KVHandoffError, match="unknown KV transport"):
        kv_transfer_config(transport="nfs")
    with pytest.raises(KVHandoffError, match="pull-only"):
        t.put("a", None)  # type: ignore[arg-type]


def test_advertise_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADVERTISE_URL_ENV, raising=False)
    assert advertise_url("127.0.0.1", 8100) == "http://127.0.0.1:8100"
    assert advertise_url("::1", 8100) == "http://[::1]:8100"
    assert advertise_url("0.0.0.0", 8100, "http://10.1.2.3:8100/") == "http://10.1.2.3:8100"
    derived = advertise_url("0.0.0.0", 8100)
    assert derived == f"http://{socket.gethostbyname(socket.gethostname())}:8100"
    monkeypatch.setenv(ADVERTISE_URL_ENV, "http://10.9.8.7:8100")
    assert advertise_url("0.0.0.0", 8100) == "http://10.9.8.7:8100"
    with pytest.raises(KVHandoffError):
        advertise_url("0.0.0.0", 8100, "10.1.2.3:8100")
