"""KV hand-off bandwidth per transport, beside memcpy, in one interleaved run on one machine.

Moves N bytes of KV from a producer to a consumer on loopback (default 64 MiB, 256 MiB and
1 GiB) and reports GB/s (10^9 bytes/s) per transport and size — best and median over the
repeats, and each as a ratio to memcpy at that size:

* ``memcpy`` — ``np.copyto`` into a pre-touched destination, in one process: the ceiling.
* ``nixl-cma`` — NIXL READ (UCX backend, UCX's default transports, ``UCX_TLS`` unset: on one
  host UCX picks ``cma``, i.e. ``process_vm_readv``) by a consumer process from a producer
  process's registered DRAM.
* ``nixl-tcp`` — the same with ``UCX_TLS=tcp`` in both processes (what also works across
  hosts and network namespaces). UCX reads the variable when the agent is created, so each
  NIXL cell runs in fresh processes (multiprocessing, spawn) with the variable set first.
* ``http pull`` — today's ``http`` transport with the project's real pieces: the prefill's
  KV listener app (:func:`flowprefill.prefill.server.kv_http.create_kv_app` over a
  :class:`~flowprefill.kv.SharedDirTransport` directory) under uvicorn in a subprocess,
  and the decode side's :class:`~flowprefill.kv.HTTPPullTransport` ``fetch()`` pulling
  ``GET /v1/kv/<id>`` into its cache directory (temp file, size checks, rename).
* ``http write+pull`` — that pull plus the producer's ``SharedDirTransport.put`` of the
  hand-off (safetensors write into the page cache + atomic rename), in sequence.

What is timed, and what is not:

* NIXL: from ``transfer()`` to ``check_xfer_state() == "DONE"``, for one READ of the whole
  buffer, after a warm-up READ of the whole buffer (connection set-up, rkeys) and a
  re-zeroing of the destination. Agent creation, registration and the metadata exchange
  (over a multiprocessing Pipe) are not timed: a serving deployment does them once.
  The poll yields the CPU between checks (``os.sched_yield``): on these 2 shared cores a
  pure spin starved UCX's progress when the machine was busy (tcp 0.15-0.2 GB/s against
  0.3 with a 0.1 ms nap), while a nap cost tcp up to half its rate when it was idle.
  (With cma, ``transfer()`` itself does the copy and returns DONE: there is no poll.)
  Both buffers are allocated and touched before anything is timed: a cold destination
  costs page faults (the note in ../shared/notes/nixl.md saw ~1.2 s for 512 MiB; a fresh
  1 GiB buffer took 3.5 s to touch on this VM), which would swamp the transfer.
* memcpy: one ``np.copyto`` after a warm-up copy and a re-zeroing of the destination.
* http: ``put`` (write) and ``fetch`` (pull) separately. Not timed: ``build_handoff``
  (validation + CRC-32 of the tensors; benchmarks/kv/handoff.py times it), and the
  CRC-32 pass over every byte that decode's ``fetch`` runs by default
  (``verify_checksum``; handoff.py's ``verify_ms``) — it is switched off here so the pull
  is comparable with the raw NIXL READ. The pull is preceded by the transport's own
  ``header()`` range request, as in decode (the scheduler reads the header first), which
  also opens the keep-alive connection (the warm-up). The served file was just written,
  so it is read from the page cache, as on a prefill instance; dirty pages of earlier
  cells being written back to disk add noise to every transport.

Payload: a Llama-3-8B-shaped prompt KV (32 layers x 8 KV heads x head_dim 128, bfloat16:
128 KiB per token); each size is rounded up to whole tokens (64 MiB = 512 tokens, 1 GiB =
8192) and every transport moves that many bytes. The http rows move the hand-off file,
which adds the token ids (8 B per token) and the safetensors header (~5 KiB): their GB/s
count the file's bytes.

Every transfer is checked: the consumer's CRC-32 of the bytes it received must equal the
producer's CRC-32 of what it sent (NIXL, memcpy: the buffer; http: the whole file), or
the run stops with :class:`TransferCorrupted`. The data is a 1 MiB random block repeated
with each copy's index in its first 8 bytes, so a misplaced or duplicated block fails too.

Interleaving: for each repeat, every size in ascending order and at each size every
transport, the order rotated by one per (repeat, size), so slow phases of the shared
machine spread over all transports. Buffers live for one cell (one transport, one size,
one repeat) and are freed after it: at 1 GiB a cell holds 2-3 GiB.

    python benchmarks/kv/bandwidth.py                                   # 64M,256M,1G x5
    python benchmarks/kv/bandwidth.py --sizes 64M,256M,1G --repeats 3 \\
        --json /tmp/kvbw.json --plot docs/img/kv_bandwidth.png

If no NIXL package is importable (the ``nixl_cu13``/``nixl_cu12`` wheels, or the ``nixl``
meta package over them; see :data:`NIXL_PACKAGES`), the NIXL rows say "nixl not
installed" and the rest still runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import itertools
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

TRANSPORTS = ("memcpy", "nixl-cma", "nixl-tcp", "http")
"""What one cell runs; ``http`` gives two rows (pull, write+pull)."""
ROWS = ("memcpy", "nixl-cma", "nixl-tcp", "http pull", "http write+pull")
NIXL_ENV: dict[str, dict[str, str | None]] = {
    "nixl-cma": {"UCX_TLS": None},  # None: unset, so UCX's defaults (cma on one host) apply
    "nixl-tcp": {"UCX_TLS": "tcp"},
}
NIXL_PACKAGES = ("nixl_cu13", "nixl_cu12", "nixl")
"""Where the NIXL API is imported from, first found wins. The meta package ``nixl`` (what
vLLM imports) re-exports one of the CUDA-variant wheels, the same API; but with a CPU-only
torch it imports torch to find a CUDA version (1 s, 10 s seen here under load, in every
spawned process), so the wheels are tried first, in the order it tries them."""

# A Llama-3-8B-shaped KV cache: 32 layers, 8 KV heads, head_dim 128, bfloat16.
LAYERS, KV_HEADS, HEAD_DIM, ELEMENT_BYTES = 32, 8, 128, 2
TOKEN_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * ELEMENT_BYTES  # k and v: 128 KiB per token

BLOCK = 1 << 20  # the fill pattern's period
CRC_CHUNK = 16 << 20  # file CRCs read this much at a time (no whole-file buffer)
Bytes = npt.NDArray[np.uint8]


class TransferCorrupted(RuntimeError):
    """The bytes a consumer received differ from what the producer sent."""


@dataclass
class Sample:
    """One timed transfer: ``row`` at ``nbytes`` in ``repeat`` (``slot``: its place in that
    size's rotated order)."""

    row: str
    size: str
    nbytes: int
    repeat: int
    slot: int
    seconds: float
    moved_bytes: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.moved_bytes / self.seconds / 1e9


# ---------------------------------------------------------------------------- data, checks


def parse_size(text: str) -> int:
    """``64M`` / ``1G`` / ``512K`` (binary units) or a byte count."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    value = int(float(number) * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return value


def size_label(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{nbytes} B"


def whole_tokens(nbytes: int) -> int:
    """The payload actually moved for a requested size: rounded up to whole tokens."""
    return -(-nbytes // TOKEN_BYTES) * TOKEN_BYTES


def fill_pattern(buf: Bytes, seed: int) -> None:
    """Fill ``buf`` (touching every page) with a 1 MiB random block repeated, each copy
    stamped with its index: cheap to make, and a misplaced block changes the CRC."""
    block = np.random.default_rng(seed).integers(0, 256, size=min(BLOCK, buf.size), dtype=np.uint8)
    rows = buf.size // BLOCK
    if rows:
        grid = buf[: rows * BLOCK].reshape(rows, BLOCK)
        grid[:] = block
        stamps = np.arange(rows, dtype="<u8") + (seed << 32)
        grid[:, :8] = stamps.view(np.uint8).reshape(rows, 8)
    tail = buf[rows * BLOCK :]
    tail[:] = block[: tail.size]


def crc32(buf: Bytes) -> int:
    return zlib.crc32(buf.data)


def file_crc32(path: Path) -> int:
    crc, chunk = 0, bytearray(CRC_CHUNK)
    view = memoryview(chunk)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(chunk):
            crc = zlib.crc32(view[:n], crc)
    return crc


def check_received(what: str, sent_crc: int, received_crc: int) -> None:
    """Raise :class:`TransferCorrupted` unless the CRC-32s of sent and received bytes match."""
    if sent_crc != received_crc:
        raise TransferCorrupted(
            f"{what}: the consumer received other bytes than the producer sent "
            f"(CRC-32 {received_crc:#010x}, sent {sent_crc:#010x})"
        )


# ---------------------------------------------------------------------------- memcpy


def run_memcpy(nbytes: int, seed: int) -> tuple[float, dict[str, Any]]:
    src = np.empty(nbytes, np.uint8)
    fill_pattern(src, seed)
    dst = np.zeros(nbytes, np.uint8)
    dst.fill(0)  # np.zeros may map lazily-zeroed pages: touch them
    np.copyto(dst, src)  # warm-up
    dst.fill(0)  # so the check below sees the timed copy's bytes, not the warm-up's
    t0 = time.perf_counter()
    np.copyto(dst, src)
    seconds = time.perf_counter() - t0
    check_received("memcpy", crc32(src), crc32(dst))
    return seconds, {}


# ---------------------------------------------------------------------------- NIXL


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


# ---------------------------------------------------------------------------- HTTP


def _serve_kv(root: str, port: int) -> None:
    """The prefill's KV listener app over ``root``, as the prefill server runs it."""
    import uvicorn

    from flowprefill.kv import SharedDirTransport
    from flowprefill.prefill.server.kv_http import create_kv_app

    app = create_kv_app(SharedDirTransport(root))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


class HTTPPath:
    """The ``http`` transport: a KV listener subprocess over ``<work>/prefill`` and a decode
    side pulling into ``<work>/decode-cache``. Use as a context manager (stops the server)."""

    def __init__(self, work: Path) -> None:
        from flowprefill.kv import HTTPPullTransport, SharedDirTransport

        self.port = _free_port()
        self.source = f"http://127.0.0.1:{self.port}"
        self.store = SharedDirTransport(work / "prefill")
        self.puller = HTTPPullTransport(
            work / "decode-cache", max_download_s=3600.0, verify_checksum=False
        )
        ctx = mp.get_context("spawn")
        self.server = ctx.Process(
            target=_serve_kv, args=(str(self.store.root), self.port), name="kv-listener"
        )
        self.server.start()
        self._wait_healthy(120.0)

    def _wait_healthy(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.server.is_alive():
                raise RuntimeError(f"KV listener exited with {self.server.exitcode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.source}/health", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"KV listener on {self.source} not healthy within {timeout_s:.0f} s")

    def run(self, nbytes: int, seed: int, handoff_id: str) -> tuple[float, float, dict[str, Any]]:
        """Write a ``nbytes`` hand-off and pull it; (write seconds, pull seconds, details)."""
        import torch

        from flowprefill.contracts.kv import HandoffRef
        from flowprefill.kv import ModelFingerprint, build_handoff

        tokens = nbytes // TOKEN_BYTES
        storage = torch.empty(nbytes, dtype=torch.uint8)
        fill_pattern(storage.numpy(), seed)
        kv = storage.view(torch.bfloat16).view(LAYERS, 2, KV_HEADS, tokens, HEAD_DIM)
        fingerprint = ModelFingerprint(
            model_type="llama",
            num_layers=LAYERS,
            num_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            hidden_size=4096,
            vocab_size=128256,
            rope_theta=500000.0,
        )
        layers = [(kv[i, 0], kv[i, 1]) for i in range(LAYERS)]  # contiguous views, no copy
        handoff = build_handoff(layers, range(3, 3 + tokens), fingerprint)
        t0 = time.perf_counter()
        self.store.put(handoff_id, handoff)
        write_s = time.perf_counter() - t0
        del handoff, layers, kv, storage  # the pull needs none of it: keep memory low
        served = self.store.path(handoff_id)
        file_bytes = served.stat().st_size
        sent_crc = file_crc32(served)
        ref = HandoffRef(handoff_id, source=self.source)
        try:
            self.puller.header(ref)  # as decode's scheduler does; opens the connection
            t0 = time.perf_counter()
            local = self.puller.fetch(ref)
            pull_s = time.perf_counter() - t0
            check_received(f"http pull of {handoff_id}", sent_crc, file_crc32(local))
        finally:
            self.puller.delete(ref, wait=True)  # local copy, and DELETE at the listener
            self.store.delete(handoff_id)  # in case the DELETE did not get through
        return write_s, pull_s, {"file_bytes": file_bytes}

    def __enter__(self) -> HTTPPath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.puller.close()
        self.server.terminate()  # our own child, by handle
        self.server.join(timeout=10.0)
        if self.server.is_alive():
            self.server.kill()
            self.server.join()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------- the run


def rotated(items: Sequence[str], by: int) -> list[str]:
    k = by % len(items)
    return [*items[k:], *items[:k]]


def cell_timeout_s(nbytes: int) -> float:
    """Generous: a 2-core machine shared with other work, page faults at ~0.3 GB/s."""
    return 120.0 + nbytes / 20e6


Measured = tuple[str, float, int, dict[str, Any]]
"""One row's figure from a cell: (row, seconds, bytes moved, details)."""


def run_cell(
    transport: str, nbytes: int, seed: int, module: str | None, http: HTTPPath | None
) -> list[Measured]:
    """One transport at one size, once (buffers made and freed inside)."""
    if transport == "memcpy":
        seconds, extra = run_memcpy(nbytes, seed)
        return [(transport, seconds, nbytes, extra)]
    if transport in NIXL_ENV:
        assert module is not None
        env = NIXL_ENV[transport]
        seconds, extra = run_nixl(module, env, nbytes, seed, cell_timeout_s(nbytes))
        return [(transport, seconds, nbytes, extra)]
    if transport == "http":
        assert http is not None
        write_s, pull_s, extra = http.run(nbytes, seed, f"kvbw-{uuid.uuid4().hex[:12]}")
        moved = extra["file_bytes"]
        both = {**extra, "write_s": write_s, "pull_s": pull_s}
        return [
            ("http pull", pull_s, moved, extra),
            ("http write+pull", write_s + pull_s, moved, both),
        ]
    raise ValueError(f"unknown transport {transport!r}")


def run_all(
    sizes: Sequence[int],
    repeats: int,
    transports: Sequence[str],
    work: Path,
    say: Callable[[str], None] = print,
) -> tuple[list[Sample], dict[str, str]]:
    """Every (repeat, size, transport) cell, interleaved; the samples and the rows skipped
    (row -> why)."""
    module = nixl_module()
    skipped = {t: "nixl not installed" for t in NIXL_ENV if t in transports and module is None}
    samples: list[Sample] = []
    total = repeats * len(sizes) * len(transports)
    counter = itertools.count(1)
    with contextlib.ExitStack() as stack:
        http = stack.enter_context(HTTPPath(work)) if "http" in transports else None
        for repeat in range(repeats):
            for index, nbytes in enumerate(sizes):
                label = size_label(nbytes)
                seed = repeat * 1000 + index + 1  # other bytes every cell
                for slot, transport in enumerate(rotated(transports, repeat + index)):
                    step = f"[{next(counter)}/{total}] {transport} {label}"
                    if transport in skipped:
                        say(f"{step}: skipped ({skipped[transport]})")
                        continue
                    figures = []
                    for row, seconds, moved, extra in run_cell(
                        transport, nbytes, seed, module, http
                    ):
                        sample = Sample(row, label, nbytes, repeat, slot, seconds, moved, extra)
                        samples.append(sample)
                        name = row.removeprefix(transport).strip()
                        figures.append(f"{name + ' ' if name else ''}{sample.gbps:.2f} GB/s")
                    say(f"{step}: {', '.join(figures)}")
    return samples, skipped


@dataclass
class Summary:
    row: str
    size: str
    nbytes: int
    n: int
    best_gbps: float
    median_gbps: float
    best_vs_memcpy: float | None
    median_vs_memcpy: float | None


def summarize(samples: Sequence[Sample], sizes: Sequence[int]) -> list[Summary]:
    """Best and median GB/s per (row, size), and their ratios to memcpy's at that size."""
    by: dict[tuple[str, int], list[float]] = {}
    for s in samples:
        by.setdefault((s.row, s.nbytes), []).append(s.gbps)
    out = []
    for row in ROWS:
        for nbytes in sizes:
            values = by.get((row, nbytes))
            if not values:
                continue
            base = by.get(("memcpy", nbytes))
            best, median = max(values), statistics.median(values)
            out.append(
                Summary(
                    row,
                    size_label(nbytes),
                    nbytes,
                    len(values),
                    best,
                    median,
                    best / max(base) if base else None,
                    median / statistics.median(base) if base else None,
                )
            )
    return out


def print_table(
    summary: Sequence[Summary], skipped: Mapping[str, str], sizes: Sequence[int], repeats: int
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"KV hand-off bandwidth on loopback, GB/s (10^9 B/s), best and median of {repeats}",
        title_justify="left",
    )
    for name in ("transport", "size", "best", "median", "best/memcpy", "median/memcpy"):
        table.add_column(name, justify="left" if name in ("transport", "size") else "right")

    def ratio(value: float | None) -> str:
        return "" if value is None else f"{value:.2f}"

    for row in ROWS:
        rows = [s for s in summary if s.row == row]
        if row in skipped:
            for nbytes in sizes:
                table.add_row(row, size_label(nbytes), skipped[row], "", "", "")
        for s in rows:
            table.add_row(
                row,
                s.size,
                f"{s.best_gbps:.2f}",
                f"{s.median_gbps:.2f}",
                ratio(s.best_vs_memcpy),
                ratio(s.median_vs_memcpy),
            )
        if rows or row in skipped:
            table.add_section()
    Console(width=100).print(table)


def plot(summary: Sequence[Summary], path: Path, repeats: int) -> bool:
    """GB/s against size per transport (median, best as hollow markers); False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for row in ROWS:
        rows = sorted((s for s in summary if s.row == row), key=lambda s: s.nbytes)
        if not rows:
            continue
        x = [s.nbytes / 2**20 for s in rows]
        (line,) = ax.plot(x, [s.median_gbps for s in rows], marker="o", label=row)
        ax.plot(
            x, [s.best_gbps for s in rows], linestyle="none", marker="^",
            markerfacecolor="none", color=line.get_color(),
        )  # fmt: skip
    ax.set_xscale("log", base=2)
    ticks = sorted({s.nbytes for s in summary})
    ax.set_xticks([t / 2**20 for t in ticks], [size_label(t) for t in ticks])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("hand-off size")
    ax.set_ylabel("GB/s (10^9 B/s)")
    ax.set_title(
        f"KV hand-off bandwidth, producer → consumer on loopback (median of {repeats}, △ best)"
    )
    ax.title.set_fontsize(10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print the table; exit status 0. A corrupted transfer raises TransferCorrupted."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--sizes", default="64M,256M,1G", help="comma list: 64M, 1G, 4096...")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--transports", default=",".join(TRANSPORTS), help=f"subset of {','.join(TRANSPORTS)}"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every sample here")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of GB/s vs size")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    requested = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    sizes = sorted({whole_tokens(n) for n in requested})
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = sorted(set(transports) - set(TRANSPORTS))
    if unknown or not transports:
        parser.error(f"--transports: unknown {unknown}; choose from {', '.join(TRANSPORTS)}")
    module = nixl_module()
    print(
        f"sizes {', '.join(size_label(n) for n in sizes)} (whole {TOKEN_BYTES // 1024} KiB "
        f"tokens of a Llama-3-8B-shaped KV), {args.repeats} repeat(s), transports "
        f"{', '.join(transports)}; NIXL: {module or 'not installed'}",
        flush=True,
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvbw-") as tmp:
        samples, skipped = run_all(
            sizes, args.repeats, transports, Path(tmp), lambda m: print(m, flush=True)
        )
    summary = summarize(samples, sizes)
    print(f"done in {time.monotonic() - started:.0f} s")
    print_table(summary, skipped, sizes, args.repeats)
    if args.json is not None:
        out = {
            "config": {
                "sizes": sizes,
                "requested_sizes": requested,
                "repeats": args.repeats,
                "transports": transports,
                "token_bytes": TOKEN_BYTES,
                "nixl_module": module,
                "cpus": os.cpu_count(),
                "gbps_unit": "1e9 bytes/s",
            },
            "skipped": skipped,
            "samples": [{**asdict(s), "gbps": s.gbps} for s in samples],
            "summary": [asdict(s) for s in summary],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
        print(f"samples: {args.json}")
    if args.plot is not None:
        print(
            f"plot: {args.plot}"
            if plot(summary, args.plot, args.repeats)
            else "plot: no matplotlib"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
