"""Simulator vs the real engine on this CPU: same workload, predicted vs measured TTFT.

1. Profile the real executor (``flowprefill profile``'s code path) on a built-in model.
2. Serve a scaled-down QwenTrace-like workload with the real ``PrefillEngine`` (S-EDF,
   SLO-aware batching, operator-level preemption), recording every request's TTFT.
3. Replay exactly those arrivals in the simulator with the profile as the cost model
   (``flowprefill simulate --profile P --compare-measured M``) and report the error.

    python benchmarks/sim/validate_engine.py [--model demo-llama] [--num-requests 150]

Prompts are Table 1 lengths divided by ``--length-divisor`` (the CPU model is ~10⁴×
slower than an A100); SLOs are Table 2's for Llama3-8B. Timing on a shared 2-core box
is noisy: the error reported includes that noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from flowprefill.bench.workload import qwen_like
from flowprefill.lab.sim.config import CostSpec, SweepConfig
from flowprefill.lab.sim.validate import compare_with_measured, load_measured
from flowprefill.models import build_named
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.factory import profile_executor
from flowprefill.prefill.predictor.model import TTFTPredictor


def measure_again(
    executor: PreemptibleExecutor, predictor: TTFTPredictor, gen: torch.Generator
) -> list[tuple[int, float]]:
    """One timed prefill per profiled length."""
    out = []
    for n, _ in predictor.samples:
        ids = torch.randint(0, executor.vocab_size, (n,), generator=gen)
        t0 = time.perf_counter()
        executor.prefill([ids])
        out.append((n, time.perf_counter() - t0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo-llama")
    ap.add_argument("--num-requests", type=int, default=150)
    ap.add_argument("--rate", type=float, default=5.0, help="requests per second")
    ap.add_argument("--length-divisor", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=1536)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for profile.json and measured.jsonl")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timing)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out or tempfile.mkdtemp(prefix="sim-validate-"))
    out.mkdir(parents=True, exist_ok=True)

    model = build_named(args.model, seed=0)
    with PreemptibleExecutor(model, granularity="operator") as executor:
        t0 = time.perf_counter()
        report = profile_executor(
            executor, min_tokens=16, max_tokens=args.max_tokens, num_points=8, repeats=3
        )
        predictor = report.predictor
        predictor.save(out / "profile.json")
        print(f"profiled in {time.perf_counter() - t0:.0f} s: {predictor.fit_error}")

        workload = qwen_like(args.num_requests, seed=args.seed)
        gen = torch.Generator().manual_seed(args.seed)
        plan = []
        for req in workload.requests(args.rate):
            n = max(16, min(args.max_tokens, req.num_tokens // args.length_divisor))
            prompt = torch.randint(0, executor.vocab_size, (n,), generator=gen).tolist()
            plan.append((req.request_id, req.arrival_s, prompt, req.ttft_slo_s, req.slo_class))

        records = []
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        with PrefillEngine(executor, predictor) as engine:
            start = time.monotonic() + 0.2
            futures = []
            for rid, at, prompt, slo, cls in plan:
                delay = start + at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                futures.append(
                    (
                        len(prompt),
                        engine.submit(prompt, ttft_slo_s=slo, slo_class=cls, request_id=rid),
                    )
                )
            for n, fut in futures:
                res = fut.result(timeout=600)
                records.append(
                    {
                        "request_id": res.request_id,
                        "arrival_s": res.arrival_s,
                        "num_tokens": n,
                        "ttft_slo_s": res.ttft_slo_s,
                        "slo_class": res.slo_class,
                        "ttft_s": res.ttft_s,
                    }
                )
            engine_blocking = list(engine.blocking_times_s)
        serve_cpu_s = time.process_time() - cpu0
        print(
            f"engine served {len(records)} requests in {time.perf_counter() - t0:.0f} s "
            f"using {serve_cpu_s:.1f} s of CPU"
        )
        # Drift check: time the profiled lengths again right after serving. On a shared
        # box the same prefill can run 30 % slower minutes later (other tenants, clocks).
        post = [(n, t) for n, t in measure_again(executor, predictor, gen)]
        drift = statistics.median(t / predictor.predict_s(n) for n, t in post)
        print(
            f"after serving, profiled prefills take {drift:.2f}× the profile's prediction "
            f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
        )
        fit = predictor.fit_error
        if not 0.9 <= drift <= 1.1 or (fit is not None and fit.mean_abs_pct > 5):
            print(
                "WARNING: the machine's speed changed during the run (other tenants?): "
                "the comparison below measures that noise; rerun on a quiet machine"
            )

    measured = out / "measured.jsonl"
    measured.write_text("".join(json.dumps(r) + "\n" for r in records))
    drifted = predictor.model_copy(
        update={
            "coefficients": [c * drift for c in predictor.coefficients],
            "min_latency_s": predictor.min_latency_s * drift,
        }
    )
    drifted.save(out / "profile-after.json")
    for label, path in (
        ("profile before serving", "profile.json"),
        ("× drift", "profile-after.json"),
    ):
        cost = CostSpec(profile=str(out / path), profile_layers=executor.num_layers)
        for live in (False, True):
            # The executor above runs its operators whole (built without max_blocking_ms).
            cfg = SweepConfig(
                cost=cost, systems=("flowprefill",), live_progress=live, max_blocking_ms="off"
            )
            rep = compare_with_measured(cfg, load_measured(measured), system="flowprefill")
            mode = "as the engine: live progress" if live else "earlier engine: --no-live-progress"
            print(f"simulator ({label}, {mode}): {rep.summary()}")
        print(
            f"  work: engine CPU {serve_cpu_s:.1f} s vs simulated device time "
            f"{rep.simulated_work_s:.1f} s"
        )
    if engine_blocking:
        mean_ms = 1e3 * statistics.fmean(engine_blocking)
        print(
            f"engine preemption blocking: {len(engine_blocking)} preemptions, "
            f"mean {mean_ms:.1f} ms, max {1e3 * max(engine_blocking):.1f} ms"
        )
    print(
        f"files in {out}/ (replay: flowprefill simulate --profile {out}/profile.json "
        f"--profile-layers {executor.num_layers} --compare-measured {measured} "
        "--systems flowprefill)"
    )


if __name__ == "__main__":
    main()
