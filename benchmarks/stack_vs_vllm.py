"""FlowPrefill stack vs vLLM alone vs our stack with FCFS: same model, same workload.

Systems (one run, one seeded QwenTrace-like workload, prompt lengths scaled down for a
CPU, SLOs = the paper's Llama-3-8B targets scaled by this machine's measured prefill speed
against an A100 — the scale is printed):

* ``flowprefill``: ``flowprefill up`` (S-EDF, operator-level preemption, SLO-aware
  batching) with one prefill and one vLLM decode instance;
* ``flowprefill-fcfs``: the same stack with ``--policy fcfs`` (no preemption);
* ``vllm-priority-cp2k``: one vLLM server alone, ``--scheduling-policy priority``,
  chunked prefill with 2048-token chunks, each request's ``priority`` from its class
  (tightest SLO first).

Every system gets the same arrivals at each rate (``flowprefill bench``); goodput is the
highest tried rate with ≥ 90 % TTFT attainment. Needs the ``decode`` extra (vLLM).

    python benchmarks/stack_vs_vllm.py [--rates 0.5,1,2,4] [--num-requests 60]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited during start-up; see {log}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        # `flowprefill up` stops its own children in order; vLLM's engine core is in the
        # server's process group.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_bench(
    url: str, out: Path, args: argparse.Namespace, slo_file: Path, vllm_priority: bool, model: str
) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "flowprefill.cli",
        "bench",
        "--url",
        url,
        "--model",
        model,
        "--workload",
        "qwen-like",
        "--num-requests",
        str(args.num_requests),
        "--rates",
        args.rates,
        "--length-scale",
        str(args.length_scale),
        "--max-prompt-tokens",
        "4000",
        "--max-tokens",
        str(args.max_tokens),
        "--vocab-size",
        "30000",
        "--slo-table",
        str(slo_file),
        "--seed",
        str(args.seed),
        "--out",
        str(out),
        # Prompts are scaled down, so is the time they need: scale the SLOs alike.
        "--slo-scale",
        str(args.length_scale),
    ]
    if vllm_priority:
        cmd += ["--vllm-priority", "--class-header", ""]
    subprocess.run(cmd, check=True)
    return json.loads((out / "bench.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="demo-llama")
    ap.add_argument("--rates", default="0.5,1,2,4")
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument("--length-scale", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=f"runs/stack-vs-vllm-{time.strftime('%Y%m%d-%H%M%S')}")
    ap.add_argument("--systems", default="flowprefill,flowprefill-fcfs,vllm-priority-cp2k")
    ap.add_argument(
        "--max-tokens", type=int, default=4, help="output tokens per request (TPOT needs >= 2)"
    )
    args = ap.parse_args()

    from flowprefill.backend import build_executor, quick_profile
    from flowprefill.contracts import EngineConfig
    from flowprefill.models import resolve_model_path
    from flowprefill.up import (
        SCALE_AT_TOKENS,
        decode_env,
        machine_scale,
        slo_table,
        vllm_server_command,
    )

    console = Console()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_path(args.model)
    with build_executor(EngineConfig(model_path=str(model_dir))) as executor:
        predictor = quick_profile(executor, console, model_name=args.model)
    profile = out / "ttft-profile.json"
    predictor.save(profile)
    scale = machine_scale(predictor.predict_s(SCALE_AT_TOKENS))
    table = slo_table(scale)
    slo_file = out / "slo.json"
    slo_file.write_text(json.dumps({c.name: c.ttft_slo_ms / 1e3 for c in table.classes}))
    console.print(
        f"SLOs = paper × {scale:.1f} (this machine vs A100 Llama-3-8B at 1K tokens) × "
        f"{args.length_scale} (prompt length scale) → "
        + ", ".join(f"{c.name} {c.ttft_slo_ms * args.length_scale:.0f} ms" for c in table.classes)
    )

    results: dict[str, dict] = {}
    port = 8800
    for system in args.systems.split(","):
        log = out / f"{system}.log"
        if system.startswith("flowprefill"):
            cmd = [
                sys.executable,
                "-m",
                "flowprefill.cli",
                "up",
                "--model",
                str(model_dir),
                "--profile",
                str(profile),
                "--port",
                str(port),
                "--run-dir",
                str(out / f"{system}-run"),
            ]
            if system == "flowprefill-fcfs":
                cmd += ["--policy", "fcfs"]
            ready = f"http://127.0.0.1:{port}/ready"
        else:
            cmd = vllm_server_command(
                model_dir,
                port,
                extra=[
                    "--scheduling-policy",
                    "priority",
                    "--enable-chunked-prefill",
                    "--max-num-batched-tokens",
                    "2048",
                ],
            )
            ready = f"http://127.0.0.1:{port}/health"
        url = f"http://127.0.0.1:{port}"
        model_name = str(model_dir)  # both the gateway and vLLM serve it under its path
        console.print(f"[b]{system}[/b]: starting")
        proc = subprocess.Popen(
            cmd,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **decode_env(out)},
            start_new_session=True,
        )
        try:
            wait_http(ready, proc, log, 600)
            if system.startswith("flowprefill"):  # decode must be up too
                deadline = time.monotonic() + 600
                while "is up" not in log.read_text(errors="replace"):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{system} did not come up; see {log}")
                    time.sleep(1)
            results[system] = run_bench(
                url, out / system, args, slo_file, system.startswith("vllm"), model_name
            )
        finally:
            stop(proc)
        port += 300

    t = Table(title="TTFT attainment by class and rate (same workload)")
    t.add_column("system")
    t.add_column("goodput req/s", justify="right")
    rates = sorted(next(iter(results.values()))["rates"], key=float)
    classes = [c.name for c in table.classes]
    for r in rates:
        t.add_column(f"@{float(r):g}/s: " + " ".join(c[:4] for c in classes), justify="right")
    for system, rep in results.items():
        cells = []
        for r in rates:
            res = rep["rates"][r]
            cells.append(
                " ".join(f"{res.get(c, {}).get('attainment', float('nan')):.0%}" for c in classes)
            )
        g = rep["goodput_req_s"]
        t.add_row(system, "-" if g is None else f"{g:g}", *cells)
    wide = Console(width=max(console.width, 40 + 28 * len(rates)))
    wide.print(t)
    overall = Table(title="all classes: attainment · time per output token p50 / p99 (ms)")
    overall.add_column("system")
    for r in rates:
        overall.add_column(f"@{float(r):g} req/s", justify="right")
    for system, rep in results.items():
        cells = []
        for r in rates:
            res = rep["rates"][r]["all"]
            p50, p99 = res.get("tpot_p50_s"), res.get("tpot_p99_s")
            tpot = "-" if p50 is None else f"{p50 * 1e3:.1f} / {p99 * 1e3:.1f}"
            cells.append(f"{res['attainment']:.0%} · {tpot}")
        overall.add_row(system, *cells)
    wide.print(overall)
    base = results.get("flowprefill", {}).get("goodput_req_s")
    for system, rep in results.items():
        g = rep["goodput_req_s"]
        if system != "flowprefill" and base and g:
            console.print(f"goodput flowprefill / {system}: {base / g:.2f}×")
        elif system != "flowprefill":
            console.print(f"goodput flowprefill / {system}: {base} vs {g} (ratio undefined)")
    (out / "summary.json").write_text(
        json.dumps(
            {
                "slo_scale": scale,
                "slo_ms": {c.name: c.ttft_slo_ms for c in table.classes},
                "goodput_req_s": {s: r["goodput_req_s"] for s, r in results.items()},
            },
            indent=2,
        )
    )
    console.print(f"reports in {out}")


if __name__ == "__main__":
    main()
