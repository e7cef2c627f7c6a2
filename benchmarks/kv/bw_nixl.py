"""The ``nixl-cma`` and ``nixl-tcp`` rows of benchmarks/kv/bandwidth.py: a NIXL READ (UCX
backend) by a consumer process from a producer process's registered DRAM.

* ``nixl-cma`` — UCX's default transports, ``UCX_TLS`` unset: on one host UCX picks
  ``cma``, i.e. ``process_vm_readv``.
* ``nixl-tcp`` — the same with ``UCX_TLS=tcp`` in both processes (what also works across
  hosts and network namespaces). UCX reads the variable when the agent is created, so each
  NIXL cell runs in fresh processes (multiprocessing, spawn) with the variable set first.
  The spawned children import this module to find their targets
  (:func:`_nixl_producer`, :func:`_nixl_consumer`).

What is timed: from ``transfer()`` to ``check_xfer_state() == "DONE"``, for one READ of the
whole buffer, after a warm-up READ of the whole buffer (connection set-up, rkeys) and a
re-zeroing of the destination. Agent creation, registration and the metadata exchange
(over a multiprocessing Pipe) are not timed: a serving deployment does them once.
The poll yields the CPU between checks (``os.sched_yield``): on these 2 shared cores a
pure spin starved UCX's progress when the machine was busy (tcp 0.15-0.2 GB/s against
0.3 with a 0.1 ms nap), while a nap cost tcp up to half its rate when it was idle.
(With cma, ``transfer()`` itself does the copy and returns DONE: there is no poll.)
Both buffers are allocated and touched before anything is timed: a cold destination
costs page faults (the note in ../shared/notes/nixl.md saw ~1.2 s for 512 MiB; a fresh
1 GiB buffer took 3.5 s to touch on this VM), which would swamp the transfer.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import multiprocessing as mp
import os
import queue
import time
import traceback
import uuid
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from benchmarks.kv.bw_common import TransferCorrupted, check_received, crc32, fill_pattern

NIXL_ENV: dict[str, dict[str, str | None]] = {
    "nixl-cma": {"UCX_TLS": None},  # None: unset, so UCX's defaults (cma on one host) apply
    "nixl-tcp": {"UCX_TLS": "tcp"},
}
NIXL_PACKAGES = ("nixl_cu13", "nixl_cu12", "nixl")
"""Where the NIXL API is imported from, first found wins. The meta package ``nixl`` (what
vLLM imports) re-exports one of the CUDA-variant wheels, the same API; but with a CPU-only
torch it imports torch to find a CUDA version (1 s, 10 s seen here under load, in every
spawned process), so the wheels are tried first, in the order it tries them."""


def nixl_module() -> str | None:
    """The importable NIXL python API module (``<package>._api``), or None."""
    for package in NIXL_PACKAGES:
        with contextlib.suppress(ImportError, ValueError):
            if importlib.util.find_spec(package) is not None:
                return f"{package}._api"
    return None


def _nixl_agent(module: str, env: Mapping[str, str | None], role: str) -> Any:
    """A NIXL agent with the UCX backend, created after ``env`` is applied (UCX reads
    ``UCX_TLS`` once, when the backend starts)."""
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # an INFO line per agent otherwise
    api = importlib.import_module(module)
    name = f"kvbw-{role}-{uuid.uuid4().hex[:8]}"  # fresh names: a reused one confuses peers
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _nixl_producer(
    module: str,
    env: Mapping[str, str | None],
    nbytes: int,
    seed: int,
    peer: Connection,
    report: Any,
) -> None:
    """Producer: fill and register ``nbytes`` of DRAM, send the consumer its agent metadata,
    address and CRC-32, then wait for the consumer's "bye" while collecting notifications
    (the consumer's READs carry one each); report them to the parent."""
    try:
        agent = _nixl_agent(module, env, "producer")
        buf = np.empty(nbytes, np.uint8)
        fill_pattern(buf, seed)
        reg = agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
        peer.send(
            {
                "metadata": agent.get_agent_metadata(),
                "addr": buf.ctypes.data,
                "nbytes": nbytes,
                "crc": crc32(buf),
            }
        )
        notes: list[bytes] = []
        # Polling notifications also drives UCX progress on this side (the tcp transport
        # needs the target to answer); 5 ms naps keep this process off the CPU.
        while not peer.poll(0.005):
            for msgs in agent.get_new_notifs().values():
                notes.extend(msgs)
        peer.recv()
        deadline = time.monotonic() + 10.0
        while b"timed" not in notes and time.monotonic() < deadline:
            for msgs in agent.get_new_notifs().values():
                notes.extend(msgs)
            time.sleep(0.001)
        agent.deregister_memory(reg)
        report.put(("producer", "ok", {"notifs": [n.decode() for n in notes]}))
    except BaseException:
        report.put(("producer", "error", traceback.format_exc()))


def _nixl_consumer(
    module: str, env: Mapping[str, str | None], nbytes: int, peer: Connection, report: Any
) -> None:
    """Consumer: register a pre-touched destination, load the producer's metadata, READ the
    whole buffer once to warm up, re-zero, READ it again timed, check its CRC-32, say bye."""
    try:
        agent = _nixl_agent(module, env, "consumer")
        dst = np.zeros(nbytes, np.uint8)
        dst.fill(0)  # pre-touch: page faults are not what is measured
        reg = agent.register_memory([(dst.ctypes.data, nbytes, 0, "")], "DRAM")
        if not peer.poll(120.0):
            raise TimeoutError("no metadata from the producer within 120 s")
        info = peer.recv()
        remote = agent.add_remote_agent(info["metadata"])
        local_descs = agent.get_xfer_descs([(dst.ctypes.data, nbytes, 0)], "DRAM")
        remote_descs = agent.get_xfer_descs([(info["addr"], info["nbytes"], 0)], "DRAM")

        def read(tag: bytes) -> float:
            handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote, tag)
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            while state == "PROC":
                os.sched_yield()  # see the module docstring: neither spin nor nap
                state = agent.check_xfer_state(handle)
            seconds = time.perf_counter() - t0
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL READ of {nbytes} bytes ended in state {state}")
            return seconds

        warmup_s = read(b"warmup")
        dst.fill(0)  # so the check sees the timed READ's bytes, not the warm-up's
        seconds = read(b"timed")
        check_received(f"NIXL READ ({env})", info["crc"], crc32(dst))
        peer.send("bye")
        agent.deregister_memory(reg)
        api = type(agent).__module__  # which wheel's API ran (nixl_cu13._api, ...)
        report.put(("consumer", "ok", {"seconds": seconds, "warmup_s": warmup_s, "api": api}))
    except BaseException:
        report.put(("consumer", "error", traceback.format_exc()))


def run_nixl(
    module: str, env: Mapping[str, str | None], nbytes: int, seed: int, timeout_s: float
) -> tuple[float, dict[str, Any]]:
    """One NIXL cell in two fresh processes; the timed READ's seconds and details."""
    ctx = mp.get_context("spawn")  # fresh processes: UCX_TLS must be set before UCX starts
    report = ctx.Queue()
    a, b = ctx.Pipe()
    procs = [
        ctx.Process(target=_nixl_producer, args=(module, env, nbytes, seed, a, report)),
        ctx.Process(target=_nixl_consumer, args=(module, env, nbytes, b, report)),
    ]
    for proc in procs:
        proc.start()
    got: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < 2:
            try:
                role, status, payload = report.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"NIXL {dead[0].name} exited with {dead[0].exitcode} before reporting"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"NIXL cell of {nbytes} bytes: over {timeout_s:.0f} s"
                    ) from None
                continue
            if status == "error":
                if "TransferCorrupted" in payload:
                    raise TransferCorrupted(f"NIXL {role} ({env}):\n{payload}")
                raise RuntimeError(f"NIXL {role} ({env}) failed:\n{payload}")
            got[role] = payload
    finally:
        for proc in procs:
            proc.join(timeout=10.0)
            if proc.is_alive():  # only ours, by handle
                proc.kill()
                proc.join()
        report.close()
        a.close()
        b.close()
    consumer = got["consumer"]
    notifs = got["producer"]["notifs"]
    if "timed" not in notifs:
        raise RuntimeError(f"NIXL producer never got the READ's notification (got {notifs})")
    details = {"warmup_s": consumer["warmup_s"], "notifs": notifs, "api": consumer["api"]}
    return consumer["seconds"], details
