"""Capping vLLM's idle busy-wait: a capped reader sleeps on its socket instead of spinning,
in slices short enough that a dropped notification costs milliseconds, not vLLM's 5 s."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from flowprefill.contracts.deployment import VLLM_IDLE_SPIN_ENV as IDLE_SPIN_ENV
from flowprefill.kv.vllm_idle import POLL_SLICE_MS, cap_idle_spin

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
zmq = pytest.importorskip("zmq")


@pytest.fixture
def reader() -> Iterator[Any]:
    original = shm_broadcast.SpinCondition.wait
    context = zmq.Context()
    address = f"inproc://spin-{time.monotonic_ns()}"
    writer = shm_broadcast.SpinCondition(is_reader=False, context=context, notify_address=address)
    r = shm_broadcast.SpinCondition(is_reader=True, context=context, notify_address=address)
    try:
        yield r
    finally:
        shm_broadcast.SpinCondition.wait = original
        for sock in (writer.local_notify_socket, r.local_notify_socket):
            sock.close(linger=0)
        r.read_cancel_socket.close(linger=0)
        r.write_cancel_socket.close(linger=0)
        context.term()


def _wait_s(reader: Any) -> float:
    reader.record_read()  # a step just finished
    t0 = time.monotonic()
    reader.wait(timeout_ms=200)  # nothing is written: spin (returns at once) or sleep
    return time.monotonic() - t0


SLICE_S = POLL_SLICE_MS / 1000


def test_uncapped_reader_spins_capped_reader_sleeps(reader: Any) -> None:
    assert _wait_s(reader) < 0.005  # vLLM's own behaviour: back to the caller to spin again
    assert cap_idle_spin(0.0) == 0.0
    # Now it sleeps on its notification socket, for one slice rather than the 200 ms asked.
    assert 0.8 * SLICE_S <= _wait_s(reader) < 0.15
    assert reader.busy_loop_s == 0.0
    cap_idle_spin(0.0)  # idempotent: one wrapper, not a chain
    assert shm_broadcast.SpinCondition.wait.__flowprefill_original__ is not None


def test_environment_decides(reader: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IDLE_SPIN_ENV, raising=False)
    assert cap_idle_spin() is None
    monkeypatch.setenv(IDLE_SPIN_ENV, "soon")
    assert cap_idle_spin() is None
    monkeypatch.setenv(IDLE_SPIN_ENV, "-1")
    assert cap_idle_spin() is None
    assert _wait_s(reader) < 0.005
    monkeypatch.setenv(IDLE_SPIN_ENV, "0.05")
    assert cap_idle_spin() == 0.05
    assert _wait_s(reader) < 0.005  # within the 50 ms window it still spins
    time.sleep(0.06)
    t0 = time.monotonic()
    reader.wait(timeout_ms=200)  # past it: sleeps one slice
    assert 0.8 * SLICE_S <= time.monotonic() - t0 < 0.15


def _read_all(handle: Any, count: int, out: Any) -> None:
    cap_idle_spin(0.0)
    queue = shm_broadcast.MessageQueue.create_from_handle(handle, 0)
    queue.wait_until_ready()
    latencies = []
    for _ in range(count):
        sent = queue.dequeue(timeout=60)
        latencies.append(time.monotonic() - sent)
    out.put(latencies)


def test_back_to_back_messages_reach_a_capped_reader_promptly() -> None:
    """vLLM's engine writes two messages per decode step, a fraction of a millisecond apart;
    the writer's PUB socket (send high-water mark 1) can drop the second notification. A
    reader that slept until notified then waited vLLM's 5 s recheck interval, once per
    step; with the slice it must see every message within a few slices."""
    pairs = 40
    context = multiprocessing.get_context("fork")
    writer = shm_broadcast.MessageQueue(n_reader=1, n_local_reader=1)
    results = context.Queue()
    proc = context.Process(target=_read_all, args=(writer.export_handle(), 2 * pairs, results))
    proc.start()
    try:
        writer.wait_until_ready()
        for i in range(pairs):
            time.sleep(0.01)
            writer.enqueue(time.monotonic())
            # The reader has just woken for the first message when the second is written.
            gap_end = time.perf_counter() + 0.0001 * (1 + i % 5)
            while time.perf_counter() < gap_end:
                pass
            writer.enqueue(time.monotonic())
        latencies = results.get(timeout=120)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    assert len(latencies) == 2 * pairs
    assert max(latencies) < 0.5, sorted(latencies)[-5:]


def test_importing_the_connector_module_patches_nothing() -> None:
    """The cap is applied where vLLM configures a decode process (the connector's
    constructor, tests/kv/test_connector_scheduler.py), never as a side effect of an import.
    A fresh interpreter: this one may have built a connector already."""
    code = (
        "import flowprefill.kv.connector\n"
        "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition\n"
        "assert not hasattr(SpinCondition.wait, '__flowprefill_original__')\n"
    )
    env = {**os.environ, IDLE_SPIN_ENV: "0"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
