"""``flowprefill up`` under faults: a killed prefill, decode or gateway process is restarted
and traffic returns to it; requests in flight on a killed prefill are retried on the other
instance (nothing had reached the client), so none fails; those on a killed decode get a
clear error, and none of their KV hand-offs is left on disk."""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from flowprefill.contracts.deployment import DECODE_PORT, GATEWAY_PORT, PREFILL_PORT
from flowprefill.contracts.metrics import PREFILL_REQUESTS
from tests.helpers import UpProcess, start_up, stop_tree


class Stack(UpProcess):
    """An ``up`` stack (a gateway, prefill and decode instances), its children by name."""

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def prefill(self, i: int) -> str:
        return f"http://127.0.0.1:{self.port + PREFILL_PORT - GATEWAY_PORT + i}"

    def decode(self, i: int) -> str:
        return f"http://127.0.0.1:{self.port + DECODE_PORT - GATEWAY_PORT + i}"

    def pid_of(self, name: str) -> int:
        """The child ``up`` started as ``prefill-0``, ``decode-0``, ``gateway`` (by its port)."""
        if name == "gateway":
            url = self.gateway
        else:
            role, i = name.split("-")
            url = {"prefill": self.prefill, "decode": self.decode}[role](int(i))
        wanted = url.rsplit(":", 1)[1]
        for child in psutil.Process(self.proc.pid).children():
            cmd = child.cmdline()
            if "--port" in cmd and cmd[cmd.index("--port") + 1] == wanted:
                return child.pid
        raise AssertionError(f"no {name} child of up: {self.log.read_text()[-2000:]}")


def running_stack(tmp_path: Path, *flags: str) -> Iterator[Stack]:
    """`flowprefill up` with these flags for the test; it must stop cleanly on SIGINT."""
    up = start_up(tmp_path, *flags)
    try:
        yield Stack(up.proc, up.log, up.port)
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0, up.log.read_text()
    finally:
        stop_tree(up.proc)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    # Faults, not overload, are under test: a request retried after its instance died may
    # wait well past its class's target on this machine, and must still be served.
    yield from running_stack(
        tmp_path, "--decode", "0", "--prefill", "2", "--useful-wait-floor", "600"
    )


@dataclass
class Load:
    """Clients sending prefill-only requests in a loop until stopped; what they got."""

    url: str
    statuses: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def client(self, k: int) -> None:
        prompt = [1 + (k * 7 + i) % 2000 for i in range(1500 + 500 * k)]
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1}
                try:
                    r = c.post(f"{self.url}/v1/completions", json=body)
                except httpx.TransportError as e:
                    self.errors.append(type(e).__name__)
                    time.sleep(0.1)
                    continue
                self.statuses.append(r.status_code)


def _served_by(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(PREFILL_REQUESTS + "_total")
    )


def _run_load(url: str, clients: int) -> tuple[Load, list[threading.Thread]]:
    load = Load(url)
    threads = [threading.Thread(target=load.client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    return load, threads


def _stop(load: Load, threads: list[threading.Thread]) -> None:
    load.stop.set()
    for t in threads:
        t.join(90)


def test_killed_prefill_is_restarted_and_no_request_fails(stack: Stack) -> None:
    load, threads = _run_load(stack.gateway, clients=4)
    try:
        time.sleep(2)  # requests in flight on both instances
        os.kill(stack.pid_of("prefill-0"), signal.SIGKILL)
        stack.wait_log("prefill-0 died (killed by SIGKILL)")
        stack.wait_log("prefill-0 restarted")
        deadline = time.monotonic() + 120
        while True:  # traffic returns to the restarted instance
            try:
                if _served_by(stack.prefill(0)) >= 2:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "no request reached the restarted prefill-0"
            time.sleep(0.5)
    finally:
        _stop(load, threads)
    assert load.errors == [] and load.statuses and set(load.statuses) == {200}, (
        load.errors,
        sorted(set(load.statuses)),
    )


def test_killed_gateway_is_restarted(stack: Stack) -> None:
    load, threads = _run_load(stack.gateway, clients=2)
    try:
        time.sleep(1)
        os.kill(stack.pid_of("gateway"), signal.SIGKILL)
        stack.wait_log("gateway died (killed by SIGKILL)")
        stack.wait_log("gateway restarted")
        served = len(load.statuses)
        deadline = time.monotonic() + 120
        while len(load.statuses) < served + 3:  # clients are served again
            assert time.monotonic() < deadline, "the restarted gateway served nothing"
            time.sleep(0.2)
    finally:
        _stop(load, threads)
    # Connections to the dead gateway failed at the transport level (the process was
    # gone); every answer the clients did get was a success.
    assert set(load.statuses) == {200}, sorted(set(load.statuses))


# --- a decode instance killed under load (real vLLM) ------------------------------------


@dataclass
class DecodeLoad:
    """Clients sending requests that need decode (16 tokens) in a loop until stopped; each
    answer's status and error message. A client that waits past its timeout would be a
    hang: it is recorded as a transport error."""

    url: str
    answers: list[tuple[int, str]] = field(default_factory=list)
    """(status, error message) of each answer; status -1: a 200 short of its tokens."""
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def client(self, k: int) -> None:
        prompt = [5 + (k * 31 + i) % 30000 for i in range(64)]
        body = {"model": "demo-llama", "prompt": prompt, "max_tokens": 16, "ignore_eos": True}
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                try:
                    r = c.post(f"{self.url}/v1/completions", json=body)
                except httpx.TransportError as e:
                    self.errors.append(type(e).__name__)
                    time.sleep(0.1)
                    continue
                if r.status_code == 200:  # every token: 16, or a wrong success
                    tokens = r.json()["usage"]["completion_tokens"]
                    self.answers.append((r.status_code if tokens == 16 else -1, r.text))
                else:
                    self.answers.append((r.status_code, _error_message(r)))
                if r.status_code != 200:
                    time.sleep(0.1)  # decode is down: do not spin

    def served(self) -> int:
        return sum(1 for status, _ in self.answers if status == 200)


def _error_message(r: httpx.Response) -> str:
    """The message of an OpenAI-style error body, or what came instead."""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error body: {r.text[:200]!r}"


def _until(what: Callable[[], bool], timeout_s: float, failure: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, failure()
        time.sleep(0.2)


def _decoding(url: str) -> bool:
    """vLLM has requests running (its own gauge)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return False
    running = [line for line in text.splitlines() if line.startswith("vllm:num_requests_running")]
    return any(float(line.rsplit(" ", 1)[1]) > 0 for line in running)


@pytest.fixture
def decode_stack(tmp_path: Path) -> Iterator[Stack]:
    # The file path (shared_dir): the test checks that no hand-off file leaks.
    yield from running_stack(
        tmp_path, "--model", "demo-llama", "--prefill", "1", "--decode", "1",
        "--kv-transport", "shared_dir",
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (pip install -e '.[up]'; see README)",
)
def test_killed_decode_fails_its_requests_clearly_and_leaks_no_handoff(
    decode_stack: Stack, tmp_path: Path
) -> None:
    """SIGKILL of vLLM's API server (the process ``up`` started) while it decodes: its
    requests get a 502/503 naming decode, never a hang; ``up`` kills what it left behind
    (the engine core) and restarts it; requests succeed again; and every KV hand-off is
    deleted — a dead connector deletes nothing, so the gateway releases them."""
    stack = decode_stack
    kv_dir = tmp_path / "run" / "kv"  # the shared_dir transport's directory
    load = DecodeLoad(stack.gateway)
    threads = [threading.Thread(target=load.client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        _until(lambda: load.served() >= 3, 120, lambda: f"decode never served: {load.answers}")
        _until(lambda: _decoding(stack.decode(0)), 60, lambda: "no request reached decode")
        victim = psutil.Process(stack.pid_of("decode-0"))
        left_behind = victim.children(recursive=True)  # vLLM's engine core and its worker
        assert left_behind
        victim.kill()
        stack.wait_log("decode-0 died (killed by SIGKILL)")
        _, alive = psutil.wait_procs(left_behind, timeout=30)
        assert not alive, f"the dead decode's processes outlived it: {alive}"
        stack.wait_log("decode-0 restarted")
        served = load.served()  # nothing succeeds without decode: what follows is the new one
        _until(
            lambda: load.served() > served,
            180,
            lambda: f"the restarted decode served nothing: {load.answers[-5:]}",
        )
    finally:
        load.stop.set()
        for t in threads:
            t.join(90)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert load.errors == [], load.errors  # every request was answered in time
    failed = [(status, message) for status, message in load.answers if status != 200]
    assert all(status != -1 for status, _ in failed), failed
    assert failed, "the kill failed no request"
    assert all(status in (502, 503) and "decode" in message for status, message in failed), sorted(
        set(failed)
    )
    # Released in the background once each request ended: poll, bounded.
    _until(lambda: not any(kv_dir.iterdir()), 15, lambda: f"left: {sorted(kv_dir.iterdir())}")
