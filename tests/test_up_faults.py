"""``flowprefill up`` under faults: a killed prefill or gateway process is restarted and
traffic returns to it; requests in flight on a killed prefill are retried on the other
instance (nothing had reached the client), so none fails."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from flowprefill.contracts.deployment import GATEWAY_PORT, PREFILL_PORT
from flowprefill.contracts.metrics import PREFILL_REQUESTS
from tests.helpers import UpProcess, start_up


class Stack(UpProcess):
    """An ``up`` stack of one gateway and two prefill instances, its children by name."""

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def prefill(self, i: int) -> str:
        return f"http://127.0.0.1:{self.port + PREFILL_PORT - GATEWAY_PORT + i}"

    def pid_of(self, name: str) -> int:
        """The child ``up`` started as ``prefill-0``, ``gateway``, ... (by its port)."""
        port = self.gateway if name == "gateway" else self.prefill(int(name.split("-")[1]))
        wanted = port.rsplit(":", 1)[1]
        for child in psutil.Process(self.proc.pid).children():
            cmd = child.cmdline()
            if "--port" in cmd and cmd[cmd.index("--port") + 1] == wanted:
                return child.pid
        raise AssertionError(f"no {name} child of up: {self.log.read_text()[-2000:]}")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    up = start_up(tmp_path, "--decode", "0", "--prefill", "2")
    try:
        yield Stack(up.proc, up.log, up.port)
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0, up.log.read_text()
    finally:
        if up.proc.poll() is None:
            up.proc.kill()


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
