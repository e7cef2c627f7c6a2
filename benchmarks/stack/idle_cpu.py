"""What an idle ``flowprefill up`` costs this machine's cores, per process.

::

    python benchmarks/stack/idle_cpu.py [--idle-s 5] [--requests 4] [--model demo-llama]
        [--variants nixl,nixl-progress,shared_dir]

Starts one stack after another — ``--kv-transport nixl`` as ``up`` runs it on a CPU host
(no NIXL progress thread), the same with ``--nixl-progress-thread`` (NIXL's progress
threads on, as on a GPU node), and ``--kv-transport shared_dir`` (the file path) — sends
each ``--requests`` chat completions one after another, waits 2 s (past vLLM's 1 s
busy-wait after a step) and then measures the CPU time each process uses over
``--idle-s`` seconds of no traffic. Prints a table: % of one core per role, and the mean
latency of the requests (4 tokens each).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI
from rich.console import Console
from rich.table import Table

# Run as a script: the repository root goes on the path so that ``benchmarks`` imports.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.stack.common import Server, up_server, wait_all
from flowprefill.models import resolve_model_path
from flowprefill.prefill.predictor.model import TTFTPredictor

VARIANTS = {  # --variants key: (row label, up's extra arguments)
    "nixl": ("nixl (CPU default)", ["--kv-transport", "nixl"]),
    "nixl-progress": (
        "nixl + progress threads",
        ["--kv-transport", "nixl", "--nixl-progress-thread"],
    ),
    "shared_dir": ("shared_dir", ["--kv-transport", "shared_dir"]),
}
ROLES = ("prefill", "vllm-worker", "vllm-core", "vllm-api", "gateway")


def measure(server: Server, model: str, requests: int, idle_s: float) -> dict[str, float]:
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    latencies = []
    for i in range(requests):
        start = time.perf_counter()
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"request {i}: " + "hello " * 40}],
            max_tokens=4,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert sum(1 for _ in stream) >= 4
        latencies.append(time.perf_counter() - start)
    time.sleep(2.0)  # past vLLM's 1 s busy-wait after its last step
    before = server.cpu_s()
    time.sleep(idle_s)
    after = server.cpu_s()
    row = {role: 100 * (after.get(role, 0.0) - before.get(role, 0.0)) / idle_s for role in ROLES}
    row["latency_ms"] = 1000 * statistics.mean(latencies)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo-llama")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=None, help="logs (default: a temp dir)")
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help="stacks to start, in order (default: all)"
    )
    args = ap.parse_args()
    chosen = args.variants.split(",")
    if unknown := [v for v in chosen if v not in VARIANTS]:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    console = Console(width=120)
    out = args.out or Path(tempfile.mkdtemp(prefix="idle-cpu-"))
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_path(args.model)
    profile = out / "profile.json"
    TTFTPredictor.linear(2e-5).save(profile)  # the TTFT predictor plays no part here

    rows: dict[str, dict[str, float]] = {}
    for i, key in enumerate(chosen):
        name, extra = VARIANTS[key]
        server = up_server(f"v{i}", model_dir, profile, out, extra)
        console.print(f"[{i + 1}/{len(chosen)}] {name}: starting ({server.log})")
        server.start()
        try:
            wait_all([server])
            rows[name] = measure(server, str(model_dir), args.requests, args.idle_s)
        finally:
            server.stop()

    table = Table(title=f"idle stack: % of one core over {args.idle_s:g} s without traffic")
    table.add_column("stack")
    for role in ROLES:
        table.add_column(role, justify="right")
    table.add_column("total", justify="right")
    table.add_column(f"latency of {args.requests} requests (ms)", justify="right")
    for name, row in rows.items():
        table.add_row(
            name,
            *(f"{row[r]:.0f}" for r in ROLES),
            f"{sum(row[r] for r in ROLES):.0f}",
            f"{row['latency_ms']:.0f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
