"""Shared test helpers: real HTTP servers on loopback."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import uvicorn


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A free port below the kernel's ephemeral range: the kernel never hands such a port
    to an outbound connection, so a server killed and restarted on it (the fault tests)
    finds it free again, where a port from the ephemeral range may meanwhile be taken by
    any process's connection ("address already in use")."""
    top = _ephemeral_start()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(top - 12000, 1024), top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free down there: any port
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    """Until ``url``/ready answers 200; fails if ``proc`` exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise AssertionError(f"server exited with {proc.returncode} before ready: {err}")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} not ready within {timeout_s}s"
        time.sleep(0.2)


@dataclass
class UpProcess:
    """``flowprefill up`` started as a user would, its log, and the gateway's port."""

    proc: subprocess.Popen[bytes]
    log: Path
    port: int

    def wait_log(self, text: str, count: int = 1, timeout_s: float = 180.0) -> None:
        """Until ``text`` appears ``count`` times in up's output; fails if up exits."""
        deadline = time.monotonic() + timeout_s
        while self.log.read_text(errors="replace").count(text) < count:
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, f"{text!r} never logged:\n{self.log.read_text()}"
            time.sleep(0.2)


def stop_tree(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """Stop ``proc`` and everything it started, whatever state it is in: SIGINT first
    (``up`` stops its children in order), then SIGKILL to what is left of the tree. For
    ``finally`` blocks: a failed test must not leave vLLM and engines running (``up``
    starts each child in a session of its own, so killing ``up`` alone orphans them)."""
    if proc.poll() is not None:
        return
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    proc.send_signal(signal.SIGINT)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    for p in tree:
        with suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()


def start_up(tmp_path: Path, *args: str) -> UpProcess:
    """``flowprefill up --model tiny-llama`` with a linear profile (no profiling run), one
    OpenMP thread per process, its run folder and model cache under ``tmp_path``, and
    ``args``; waits until it says it is up."""
    from flowprefill.prefill.predictor.model import TTFTPredictor

    port = free_port()
    profile = tmp_path / "p.json"
    TTFTPredictor.linear(2e-5).save(profile)
    env = {
        **os.environ,
        "FLOWPREFILL_MODEL_CACHE": str(tmp_path / "models"),
        "OMP_NUM_THREADS": "1",
    }
    log = tmp_path / "up.log"
    argv = [sys.executable, "-m", "flowprefill.cli", "up", "--model", "tiny-llama"]
    argv += ["--port", str(port), "--profile", str(profile), "--run-dir", str(tmp_path / "run")]
    proc = subprocess.Popen(
        [*argv, *args], stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env
    )
    up = UpProcess(proc, log, port)
    try:
        up.wait_log("is up")
    except BaseException:
        stop_tree(proc)
        raise
    return up


@contextmanager
def silent_server() -> Iterator[str]:
    """A peer that accepts connections and never answers (a hung prefill pod); its URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []

    def accept() -> None:
        try:
            while True:
                held.append(listener.accept()[0])
        except OSError:  # closed
            pass

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        for conn in held:
            conn.close()


@contextmanager
def serve_in_thread(app: Any, **kwargs: Any) -> Iterator[str]:
    """Run an ASGI app under a real uvicorn server on loopback; yields its base URL."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **kwargs)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@contextmanager
def local_stack(
    model_dir: Path,
    slo_table: Path,
    *,
    num_prefill: int = 2,
    policy: str = "s-edf",
    routing: str = "slack-aware",
    table_refresh_s: float = 0.05,
    decode_urls: tuple[str, ...] = (),
) -> Iterator[dict[str, Any]]:
    """Prefill instances (threads, real tiny model) behind a real gateway; decode instances
    only at ``decode_urls`` (none by default)."""
    from contextlib import ExitStack

    from flowprefill.contracts import Endpoint, GatewayConfig
    from flowprefill.gateway.app import create_gateway_app
    from flowprefill.gateway.cli import build_state
    from flowprefill.models import load_model
    from flowprefill.prefill.engine import PrefillEngine
    from flowprefill.prefill.executor.runner import PreemptibleExecutor
    from flowprefill.prefill.predictor.model import TTFTPredictor
    from flowprefill.prefill.server.prefill import create_app
    from flowprefill.web.errors import BodySizeLimit
    from flowprefill.web.limits import uvicorn_options

    with ExitStack() as stack:
        urls, engines = [], []
        for _ in range(num_prefill):
            # Each instance gets its own copy of the weights, as separate processes would.
            executor = stack.enter_context(PreemptibleExecutor(load_model(model_dir)))
            engine = PrefillEngine(executor, TTFTPredictor.linear(1e-5), policy=policy)
            engines.append(engine)
            urls.append(stack.enter_context(serve_in_thread(create_app(engine))))
        config = GatewayConfig(
            service="t",
            model_name="tiny",
            tokenizer_path=str(model_dir),
            decode=[Endpoint(pool="d", host="h", port=1, url=u) for u in decode_urls],
            prefill=[Endpoint(pool="p", host="h", port=1, url=u) for u in urls],
            prefill_routing=routing,
        )
        state = build_state(config, slo_table)
        state.table_refresh_s = table_refresh_s
        gw = stack.enter_context(  # served as `serve-gateway` serves it (coalesced writes)
            serve_in_thread(
                BodySizeLimit(create_gateway_app(state), 256 * 1024),
                **uvicorn_options(10.0, coalesce_writes=True),
            )
        )
        yield {"url": gw, "state": state, "engines": engines, "prefill_urls": urls}


def wait_vllm(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 600) -> None:
    """Until the vLLM server ``proc`` (logging to ``log``) answers ``/health``; fails with
    the log's tail if it exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "vLLM did not start"
        time.sleep(1)
