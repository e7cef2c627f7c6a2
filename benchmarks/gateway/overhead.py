"""Gateway overhead: latency it adds per request and requests/s it sustains (2 cores).

Stub upstreams answer instantly — a prefill stub answers a fixed first token and a decode
stub streams a few fixed tokens — so what is measured is the gateway alone: parsing,
classification, tokenization, routing, two upstream calls and the SSE relay. The stubs
speak the wire formats the gateway reads: the prefill API's models
(:mod:`flowprefill.contracts.prefill_api`) framed as the prefill server frames them (a
streamed answer: the first token, then the KV hand-off event — null here, so decode
"recomputes" — then ``[DONE]``), and vLLM's OpenAI completion stream with its usage chunk.
Each process (stubs, gateway, load generator) is separate, as in a deployment, and the
gateway is started with ``flowprefill serve-gateway`` (access log to a file here).

    python benchmarks/gateway/overhead.py [--seconds 10] [--concurrency 32] [--rounds 3]
    python benchmarks/gateway/overhead.py --baseline HEAD~1 --rounds 3    # code compared
    python benchmarks/gateway/overhead.py --prompt-tokens 2000 --ttft-slo-ms 60000  # long

Added latency = p50/p99 of (client → gateway → stubs) minus the stubs called directly in
sequence (prefill then decode, the bodies the gateway sends) by the same client,
interleaved. Sustained = completed requests/s with ``--concurrency`` clients for
``--seconds``. On a small machine the load generator and the stubs take CPU the gateway
could use, so the gateway's own CPU time per request (from /proc) is reported too, and
requests/s per gateway core (completed requests per second of the gateway's CPU time): they
depend less on what else runs (cache and scheduler contention still inflate them). With
``--baseline`` git revisions each gateway runs in its own process and the measurements
alternate between them, ``--rounds`` times.

Every answer is checked (status 200, no error event, ``[DONE]`` at the end); the command
exits 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

# Run as a script: the repository root goes on the path so that ``benchmarks`` imports as a
# package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gateway.load import (
    DEFAULT_BODIES,
    Failures,
    latency,
    long_prompt_bodies,
    throughput,
)
from benchmarks.gateway.stubs import DECODE_TOKENS, serve_stub
from benchmarks.stack.common import free_port
from flowprefill.contracts.gateway import Endpoint, GatewayConfig, HealthProbeSettings
from flowprefill.contracts.slo import SLOTable, SLOTableClass

REPO = Path(__file__).resolve().parents[2]


def start_gateway(config: Path, table: Path, port: int, src: str | None, log: Path) -> Any:
    """``flowprefill serve-gateway`` in a process of its own; ``src``: a checkout to import
    flowprefill from (an older revision's command, as it served then)."""
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "flowprefill.cli", "serve-gateway"]
    command += ["--config", str(config), "--slo-table", str(table)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    # Run from ``src``: ``python -m`` puts the working directory first on sys.path, ahead
    # of PYTHONPATH, so from the repository root every variant would import this tree.
    with log.open("ab") as out:
        return subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=src or None
        )


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass
class Variant:
    name: str
    src: str | None
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    via: list[float] = field(default_factory=list)
    direct: list[float] = field(default_factory=list)
    done: int = 0
    failures: Failures = field(default_factory=Failures)
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=lambda: {"gateway": 0.0, "stub": 0.0})
    loadgen_cpu_s: float = 0.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def checkout(rev: str, into: Path) -> str:
    """The flowprefill package as of git ``rev``, unpacked under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "flowprefill"], check=True, capture_output=True
    ).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return str(into)


def wait_ready(url: str, proc: Any = None) -> None:
    for _ in range(600):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url} exited ({proc.returncode}) before it was ready")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


def write_configs(
    tmp: Path,
    stub_port: int,
    model_dir: Path,
    ttft_slo_ms: int = 250,
    health_probe: HealthProbeSettings | None = None,
    decode_ports: list[int] | None = None,
) -> None:
    """``tmp/gw.json`` (a gateway whose prefill and decode instance is the stub at
    ``stub_port``; ``health_probe``: its probing, None: the default) and ``tmp/slo.json``
    (one class, chat, ``ttft_slo_ms``). ``decode_ports``: the decode instances, when not
    the stub at ``stub_port``."""
    table = SLOTable(
        default_class="chat",
        classes=[
            SLOTableClass(
                name="chat",
                task_type="text",
                ttft_slo_ms=ttft_slo_ms,
                priority=0,
                attainment_target=0.9,
            )
        ],
    )
    # Only the fields this run sets, so a --baseline revision reads the files too (its
    # contract models forbid fields they do not know).
    (tmp / "slo.json").write_text(table.model_dump_json(exclude_defaults=True))
    ep = Endpoint.at("s", "127.0.0.1", stub_port)
    config = GatewayConfig(
        service="bench",
        model_name="tiny",
        tokenizer_path=str(model_dir),
        prefill=[ep],
        decode=[Endpoint.at(f"d{i}", "127.0.0.1", p) for i, p in enumerate(decode_ports)]
        if decode_ports
        else [ep],
        **({"health_probe": health_probe} if health_probe is not None else {}),
    )
    (tmp / "gw.json").write_text(config.model_dump_json(exclude_defaults=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seconds", type=float, default=10.0, help="throughput time per round")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=300, help="latency samples per round")
    ap.add_argument("--warmup", type=int, default=20, help="unmeasured pairs per round")
    ap.add_argument(
        "--baseline",
        nargs="*",
        default=[],
        metavar="REV",
        help="also run the gateway as of these git revisions",
    )
    ap.add_argument(
        "--baseline-src",
        nargs="*",
        default=[],
        metavar="DIR",
        help="also run the gateway from these checkouts (a directory holding flowprefill/)",
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="a text prompt of about this many tokens (0: the default, 11 tokens)",
    )
    ap.add_argument(
        "--ttft-slo-ms",
        type=int,
        default=250,
        help="the SLO class's TTFT target (a long prompt at concurrency 32 needs more: the "
        "gateway's admission refuses what its TTFT profile predicts late)",
    )
    ap.add_argument(
        "--client", default="auto", choices=("auto", "aiohttp", "httpx"), help="load generator"
    )
    args = ap.parse_args(argv)

    from flowprefill.models import named_model_dir

    model_dir = named_model_dir("tiny-llama")
    tmp = Path(tempfile.mkdtemp())
    variants = [Variant("this tree", None)]
    for rev in args.baseline:
        variants.append(Variant(rev, checkout(rev, tmp / f"src-{rev}")))
    variants += [Variant(src, src) for src in args.baseline_src]
    stub_port = free_port()
    stub = f"http://127.0.0.1:{stub_port}"
    write_configs(tmp, stub_port, model_dir, ttft_slo_ms=args.ttft_slo_ms)
    stub_proc = mp.get_context("spawn").Process(target=serve_stub, args=(stub_port,), daemon=True)
    stub_proc.start()
    for i, v in enumerate(variants):
        v.port = free_port()
        log = tmp / f"gateway-{i}.log"
        v.proc = start_gateway(tmp / "gw.json", tmp / "slo.json", v.port, v.src, log)
    bodies = DEFAULT_BODIES
    try:
        wait_ready(stub)
        for v in variants:
            wait_ready(f"http://127.0.0.1:{v.port}", v.proc)
        if args.prompt_tokens > 0:
            bodies = long_prompt_bodies(f"http://127.0.0.1:{variants[0].port}", args.prompt_tokens)
        for _ in range(args.rounds):
            for v in variants:
                gw = f"http://127.0.0.1:{v.port}"
                via, direct = asyncio.run(
                    latency(args.client, gw, stub, args.requests, args.warmup, v.failures, bodies)
                )
                v.via += via
                v.direct += direct
                assert v.proc is not None and stub_proc.pid is not None
                before = (cpu_seconds(v.proc.pid), cpu_seconds(stub_proc.pid), own_cpu_seconds())
                t0 = time.perf_counter()
                v.done += asyncio.run(
                    throughput(args.client, gw, args.seconds, args.concurrency, v.failures, bodies)
                )
                v.wall_s += time.perf_counter() - t0
                v.cpu_s["gateway"] += cpu_seconds(v.proc.pid) - before[0]
                v.cpu_s["stub"] += cpu_seconds(stub_proc.pid) - before[1]
                v.loadgen_cpu_s += own_cpu_seconds() - before[2]
    finally:
        stub_proc.terminate()
        for v in variants:
            if v.proc is not None:
                v.proc.terminate()
                v.proc.wait()

    console = Console(width=max(Console().width, 150))
    t = Table(
        title=f"gateway overhead (stub upstreams, {len(bodies.prefill['prompt_token_ids'])} "
        f"prompt tokens, {DECODE_TOKENS} decode tokens streamed; "
        f"{args.rounds} round(s), {args.requests} sequential requests and {args.seconds:g} s "
        f"at concurrency {args.concurrency} per round; load generator: {args.client})"
    )
    for col in (
        "gateway",
        "via gw p50 ms",
        "direct p50 ms",
        "added p50 ms",
        "added p99 ms",
        "req/s",
        "gw CPU ms/req",
        "req/s per gw core",
        "CPU gw/stub/load",
        "failed",
    ):
        t.add_column(col, justify="left" if col == "gateway" else "right")
    for v in variants:
        added = [a - b for a, b in zip(v.via, v.direct, strict=True)]
        share = " / ".join(
            f"{x / v.wall_s * 100:.0f}%" for x in (*v.cpu_s.values(), v.loadgen_cpu_s)
        )
        t.add_row(
            v.name,
            f"{pct(v.via, 0.5) * 1e3:.2f}" if v.via else "-",
            f"{pct(v.direct, 0.5) * 1e3:.2f}" if v.direct else "-",
            f"{pct(added, 0.5) * 1e3:.2f}" if added else "-",
            f"{pct(added, 0.99) * 1e3:.2f}" if added else "-",
            f"{v.done / v.wall_s:.0f}",
            f"{v.cpu_s['gateway'] / max(v.done, 1) * 1e3:.2f}",
            f"{v.done / v.cpu_s['gateway']:.0f}" if v.cpu_s["gateway"] else "-",
            share,
            str(v.failures.count),
        )
    console.print(t)
    if all(v.via for v in variants):
        console.print(
            f"({os.cpu_count()} CPUs; mean sequential latency through the gateway: "
            + ", ".join(f"{v.name} {statistics.mean(v.via) * 1e3:.2f} ms" for v in variants)
            + ")"
        )
    failed = [v for v in variants if v.failures.count]
    for v in failed:
        console.print(
            f"{v.name}: {v.failures.count} request(s) failed; the first: {v.failures.first} "
            f"(gateway logs: {tmp})",
            style="red",
            markup=False,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
