"""The prefill instance's two listeners start, stop and drain together
(:mod:`flowprefill.prefill.server.listeners`), on loopback with stand-in apps: a main app whose
request is held open for as long as the test likes, and a KV app."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
from fastapi import FastAPI

from flowprefill.prefill.server.listeners import ClientLimits, Listener, listener, serve
from tests.helpers import free_port

LIMITS = ClientLimits(
    max_body_bytes=64 * 1024, body_timeout_s=10.0, header_timeout_s=10.0, drain_timeout_s=30.0
)


def _apps(release: threading.Event, entered: threading.Event) -> tuple[FastAPI, FastAPI]:
    main = FastAPI()

    @main.get("/slow")
    async def slow() -> dict[str, bool]:
        entered.set()
        await asyncio.to_thread(release.wait, 60)
        return {"done": True}

    kv = FastAPI()

    @kv.get("/v1/kv/{handoff_id}")
    async def pull(handoff_id: str) -> dict[str, str]:
        return {"handoff_id": handoff_id}

    return main, kv


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _refuses(url: str) -> bool:
    try:
        httpx.get(url, timeout=2)
    except httpx.ConnectError:
        return True
    except (httpx.ReadError, httpx.RemoteProtocolError):
        return False  # accepted, then reset or closed unanswered: stopping, not yet gone
    return False


@contextmanager
def _serving(main: Listener, kv: Listener | None) -> Iterator[list[BaseException]]:
    """``serve`` in a thread (so it installs no signal handlers); its exception, if any."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            serve(main, kv)
        except BaseException as e:  # SystemExit too: uvicorn's answer to a port in use
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield errors
    finally:
        main.should_exit = True
        thread.join(60)
        assert not thread.is_alive()


def test_the_kv_listener_serves_through_the_main_drain_then_stops() -> None:
    release, entered = threading.Event(), threading.Event()
    main_app, kv_app = _apps(release, entered)
    main_port, kv_port = free_port(), free_port()
    main = listener(main_app, "127.0.0.1", main_port, LIMITS)
    kv = listener(kv_app, "127.0.0.1", kv_port, LIMITS)
    main_url, kv_url = f"http://127.0.0.1:{main_port}", f"http://127.0.0.1:{kv_port}"
    with _serving(main, kv), ThreadPoolExecutor(1) as pool:
        _until(lambda: main.started, "the main listener never started")
        assert kv.started  # the KV listener binds first
        in_flight = pool.submit(httpx.get, f"{main_url}/slow", timeout=60)
        assert entered.wait(30)
        main.should_exit = True  # what SIGTERM does
        _until(lambda: _refuses(f"{main_url}/"), "the main listener kept accepting")
        # Draining: the held request is still running, and decode can still pull.
        assert not in_flight.done()
        assert httpx.get(f"{kv_url}/v1/kv/h1", timeout=10).json() == {"handoff_id": "h1"}
        release.set()
        assert in_flight.result(60).json() == {"done": True}
        _until(lambda: _refuses(f"{kv_url}/v1/kv/h2"), "the KV listener outlived the main one")
        assert kv.should_exit


def test_a_kv_listener_that_stops_takes_the_main_one_with_it() -> None:
    main_app, kv_app = _apps(threading.Event(), threading.Event())
    main_port = free_port()
    main = listener(main_app, "127.0.0.1", main_port, LIMITS)
    kv = listener(kv_app, "127.0.0.1", free_port(), LIMITS)
    with _serving(main, kv) as errors:
        _until(lambda: main.started, "the main listener never started")
        kv.should_exit = True
        _until(lambda: _refuses(f"http://127.0.0.1:{main_port}/"), "main kept serving")
    assert errors == []


def test_a_kv_port_in_use_stops_the_instance_before_it_takes_traffic() -> None:
    main_app, kv_app = _apps(threading.Event(), threading.Event())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        main_port = free_port()
        main = listener(main_app, "127.0.0.1", main_port, LIMITS)
        kv = listener(kv_app, "127.0.0.1", taken.getsockname()[1], LIMITS)
        with _serving(main, kv) as errors:
            _until(lambda: bool(errors), "serve kept running with its KV port taken")
        assert isinstance(errors[0], SystemExit) and errors[0].code not in (0, None)
        assert not main.started and _refuses(f"http://127.0.0.1:{main_port}/")


def test_serve_without_a_kv_listener_starts_and_stops_the_main_one() -> None:
    """shared_dir runs no KV listener: ``serve(main)`` alone is one uvicorn server."""
    main_app, _ = _apps(threading.Event(), threading.Event())
    main_port = free_port()
    main = listener(main_app, "127.0.0.1", main_port, LIMITS)
    with _serving(main, None) as errors:
        _until(lambda: main.started, "the main listener never started")
    assert errors == [] and _refuses(f"http://127.0.0.1:{main_port}/")
