"""Open streams a gateway holds: memory and file descriptors per open stream, and that
every one of N streams open at once ends whole.

For each level N of the sweep: N clients send a streamed completion through the gateway
(``flowprefill serve-gateway``) to the stub upstreams of :mod:`benchmarks.gateway.stubs`,
which hold each decode stream after its first chunk, so that N streams are open through
the gateway at once (client connection and decode connection each). Once the stub holds
all N (or ``--open-timeout`` passed), the gateway's RSS and open descriptors are read, the
stub releases the streams, and every answer is checked (200, no error event, ``[DONE]``).

    python benchmarks/gateway/streams.py [--levels 100 1000 10000] [--ramp 200] [--decode-stubs 1]

``--decode-stubs K`` spreads the streams over K decode stub processes (one Python process
accepting and holding thousands of streams on a small machine answers slowly, and the
gateway's 5 s connect timeout to decode fails what it has not accepted in time).

Memory per open stream = (gateway RSS with N open − its RSS before the first level) / N;
levels run in increasing order, so memory the allocator kept from a smaller level is
reused, not counted twice. File descriptors: a stream takes two at the gateway, one at the
stub and one at the load generator; every process raises its soft RLIMIT_NOFILE to the
hard limit, and a level the limits cannot hold is reported, not run. Exits 1 when any
stream failed.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gateway.load import GATEWAY_BODY, Failures, check_stream
from benchmarks.gateway.overhead import cpu_seconds, start_gateway, wait_ready, write_configs
from benchmarks.gateway.stubs import raise_fd_limit, serve_stub
from benchmarks.stack.common import free_port
from flowprefill.contracts.gateway import HealthProbeSettings

FDS_SPARE = 200
"""Descriptors a gateway needs besides its streams' (listening socket, pooled prefill
connections, tokenizer files, logs)."""


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Level:
    n: int
    held: int = 0
    open_s: float = 0.0
    finish_s: float = 0.0
    rss: int = 0
    fds: int = 0
    gw_cpu_s: float = 0.0
    failures: Failures | None = None
    skipped: str | None = None


async def run_level(
    level: Level, gw: str, stubs: list[str], gw_pid: int, ramp: int, open_timeout_s: float
) -> None:
    """Open ``level.n`` streams through ``gw``, measure with them held, release, check."""
    import aiohttp

    failures = Failures()
    level.failures = failures
    gate = asyncio.Semaphore(ramp)  # streams between send and their first chunk
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=open_timeout_s + 120)
    async with (
        aiohttp.ClientSession(connector=conn, timeout=timeout) as http,
        httpx.AsyncClient(timeout=30) as control,
    ):
        for stub in stubs:
            await control.post(f"{stub}/stub/hold")

        async def one() -> None:
            lines: list[str] = []
            try:
                async with gate:
                    r = await http.post(f"{gw}/v1/completions", json=GATEWAY_BODY)
                    r.raise_for_status()
                    lines.append((await r.content.readline()).decode())
                async with r:
                    lines += [line.decode() async for line in r.content]
                check_stream([line.strip() for line in lines if line.strip()])
            except Exception as e:
                failures.add(e)

        async def held() -> int | None:
            """Streams the stubs hold; None when one did not answer (busy with thousands)."""
            try:
                answers = [await control.get(f"{stub}/stub/open") for stub in stubs]
            except httpx.HTTPError:
                return None
            return sum(int(a.json()["open"]) for a in answers)

        cpu0 = cpu_seconds(gw_pid)
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one()) for _ in range(level.n)]
        with Progress(transient=True) as progress:
            bar = progress.add_task(f"opening {level.n} streams", total=level.n)
            while time.perf_counter() - t0 < open_timeout_s:
                now = await held()
                if now is not None:
                    level.held = now
                    progress.update(bar, completed=now)
                    if now + failures.count >= level.n:
                        break
                await asyncio.sleep(0.2)
        level.open_s = time.perf_counter() - t0
        level.rss, level.fds = rss_bytes(gw_pid), open_fds(gw_pid)
        t1 = time.perf_counter()
        for _ in range(10):
            try:
                for stub in stubs:
                    await control.post(f"{stub}/stub/release")
                break
            except httpx.HTTPError:
                await asyncio.sleep(0.5)
        await asyncio.gather(*tasks)
        level.finish_s = time.perf_counter() - t1
        level.gw_cpu_s = cpu_seconds(gw_pid) - cpu0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--levels", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--ramp", type=int, default=200, help="streams opening at once")
    ap.add_argument(
        "--decode-stubs",
        type=int,
        default=1,
        help="decode stub processes the streams are spread over (the first also prefills)",
    )
    ap.add_argument("--open-timeout", type=float, default=600.0, help="seconds per level")
    args = ap.parse_args(argv)

    from flowprefill.models import named_model_dir

    fd_limit = raise_fd_limit()  # inherited by the gateway and the stub
    tmp = Path(tempfile.mkdtemp())
    ports = [free_port() for _ in range(max(1, args.decode_stubs))]
    stub_port, gw_port = ports[0], free_port()
    stubs = [f"http://127.0.0.1:{p}" for p in ports]
    gw = f"http://127.0.0.1:{gw_port}"
    # A TTFT target of minutes: opening thousands of streams at once queues them at the
    # gateway for seconds on a small machine, and admission would answer 503 (useful wait
    # over) to what this benchmark means to hold.
    # Lenient health probes: the stub is one Python process holding every stream on a
    # machine the load generator and the gateway share, and can take seconds to answer
    # /health at thousands of streams; the default probes would declare it stalled and
    # abandon the streams this benchmark means to hold.
    probes = HealthProbeSettings(interval_s=5, timeout_s=60, failures=100)
    write_configs(tmp, stub_port, named_model_dir("tiny-llama"), 600_000, probes, ports)
    ctx = mp.get_context("spawn")
    stub_procs = [ctx.Process(target=serve_stub, args=(p, True), daemon=True) for p in ports]
    for proc in stub_procs:
        proc.start()
    gw_proc = start_gateway(tmp / "gw.json", tmp / "slo.json", gw_port, None, tmp / "gw.log")
    levels = [Level(n) for n in sorted(args.levels)]
    try:
        for stub in stubs:
            wait_ready(stub)
        wait_ready(gw, gw_proc)
        # Warm the gateway (imports, pools, tokenizer) before its idle RSS is read.
        warm = Level(min(10, levels[0].n))
        asyncio.run(run_level(warm, gw, stubs, gw_proc.pid, args.ramp, args.open_timeout))
        rss0 = rss_bytes(gw_proc.pid)
        for level in levels:
            if 2 * level.n + FDS_SPARE > fd_limit:
                level.skipped = f"needs RLIMIT_NOFILE ≥ {2 * level.n + FDS_SPARE} (have {fd_limit})"
                continue
            asyncio.run(run_level(level, gw, stubs, gw_proc.pid, args.ramp, args.open_timeout))
            assert level.failures is not None
            print(
                f"{level.n} streams: {level.held} held at once after {level.open_s:.1f} s, "
                f"{level.failures.count} failed",
                flush=True,
            )
    finally:
        gw_proc.terminate()
        gw_proc.wait()
        for proc in stub_procs:
            proc.terminate()

    console = Console(width=max(Console().width, 150))
    t = Table(
        title=f"open streams held by one gateway ({len(stubs)} decode stub(s) hold each stream "
        f"after its first chunk; {os.cpu_count()} CPUs; RLIMIT_NOFILE {fd_limit}; idle gateway "
        f"RSS {rss0 / 2**20:.0f} MiB)"
    )
    cols: tuple[str, ...] = (
        "open streams",
        "held at once",
        "time to open s",
        "gw RSS MiB",
        "RSS/stream KiB",
    )
    cols += ("gw fds", "gw CPU ms/stream", "finish s", "failed")
    for col in cols:
        t.add_column(col, justify="right")
    for lv in levels:
        if lv.skipped is not None:
            t.add_row(str(lv.n), *["-"] * 7, lv.skipped)
            continue
        assert lv.failures is not None
        t.add_row(
            str(lv.n),
            str(lv.held),
            f"{lv.open_s:.1f}",
            f"{lv.rss / 2**20:.0f}",
            f"{(lv.rss - rss0) / lv.n / 1024:.1f}",
            str(lv.fds),
            f"{lv.gw_cpu_s / lv.n * 1e3:.2f}",
            f"{lv.finish_s:.1f}",
            str(lv.failures.count),
        )
    console.print(t)
    failed = [lv for lv in levels if lv.failures is not None and lv.failures.count]
    for lv in failed:
        assert lv.failures is not None
        console.print(
            f"{lv.n} streams: {lv.failures.count} failed; the first: {lv.failures.first} "
            f"(gateway log: {tmp / 'gw.log'})",
            style="red",
            markup=False,
        )
    short = [lv for lv in levels if lv.skipped is None and lv.held < lv.n]
    for lv in short:
        console.print(f"{lv.n} streams: only {lv.held} were open at once", style="red")
    return 1 if failed or short else 0


if __name__ == "__main__":
    raise SystemExit(main())
