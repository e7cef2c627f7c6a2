"""Capping vLLM's idle busy-wait: a capped reader sleeps on its socket instead of spinning."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from flowprefill.kv.vllm_idle import IDLE_SPIN_ENV, cap_idle_spin

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


def test_uncapped_reader_spins_capped_reader_sleeps(reader: Any) -> None:
    assert _wait_s(reader) < 0.05  # vLLM's own behaviour: back to the caller to spin again
    assert cap_idle_spin(0.0) == 0.0
    assert _wait_s(reader) >= 0.15  # now it slept on its notification socket
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
    assert _wait_s(reader) < 0.05
    monkeypatch.setenv(IDLE_SPIN_ENV, "0.01")
    assert cap_idle_spin() == 0.01
    assert _wait_s(reader) < 0.05  # within the 10 ms window it still spins
    time.sleep(0.02)
    t0 = time.monotonic()
    reader.wait(timeout_ms=200)  # past it: sleeps
    assert time.monotonic() - t0 >= 0.15
