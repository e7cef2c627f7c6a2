"""Section 5: TTFT of an urgent short prompt that arrives while a long prefill runs, through
the real engine (flowprefill/prefill/engine.py: scheduler loop, execution pool, executor):
S-EDF with preemption at each granularity vs FCFS (which never preempts)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.gpuval.common import Context, executor_for, free_memory, memory_note, new_table
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.predictor.model import TTFTPredictor

URGENT_SLO_S = 0.25  # the paper's text class on Llama-3-8B (Table 2)
LONG_SLO_S = 6.0  # its file class


def section_urgent(ctx: Context, rec: dict[str, Any], deadline: float) -> None:
    notes: list[str] = rec.setdefault("notes", [])
    arms = [("fcfs", "operator")] + [("s-edf", g) for g in ctx.arms if g != "none"]
    # Alone runs, then per arm and trial the long prefill and a half (it is preempted).
    prefills = 4 + 1.7 * len(arms) * ctx.plan.urgent_trials
    long_n, note = ctx.fit_tokens(ctx.plan.urgent_long, prefills, deadline - time.perf_counter())
    if note is not None:
        notes.append(note)
    short_n = min(ctx.plan.urgent_short, long_n // 4)
    reason = memory_note(ctx, long_n, tasks=2)  # the long one parked, the short one running
    if reason is not None:
        rec.update(status="skipped", reason=reason)
        return
    long_prompt = ctx.prompt(long_n, seed=3).tolist()
    short_prompt = ctx.prompt(short_n, seed=4).tolist()
    alone = {"long": 0.0, "short": 0.0}
    with executor_for(ctx, "operator") as ex:
        ex.run([short_prompt], TaskControl("warm-up"))
        for name, prompt in (("long", long_prompt), ("short", short_prompt)):
            runs = []
            for _ in range(2):
                start = time.perf_counter()
                ex.run([prompt], TaskControl(name))
                runs.append(time.perf_counter() - start)
            alone[name] = min(runs)
    samples = [*ctx.prefill_samples, (long_n, alone["long"]), (short_n, alone["short"])]
    predictor = TTFTPredictor.fit(samples, degree=2 if len({n for n, _ in samples}) > 2 else 1)
    urgent_slo = max(URGENT_SLO_S, 5 * alone["short"])
    long_slo = max(LONG_SLO_S, 3 * alone["long"])
    delay_s = 0.3 * alone["long"]
    rec.update(
        long_tokens=long_n,
        short_tokens=short_n,
        alone_long_s=alone["long"],
        alone_short_s=alone["short"],
        urgent_slo_s=urgent_slo,
        long_slo_s=long_slo,
        urgent_arrives_after_s=delay_s,
    )
    trial_s = 1.5 * alone["long"] + alone["short"] + delay_s
    rows = []
    for policy, gran in arms:
        arm = f"{policy} / {gran}"
        if time.perf_counter() + trial_s * ctx.plan.urgent_trials > deadline:
            notes.append(f"{arm}: not run (budget)")
            continue
        rows.append(trials(ctx, arm, policy, gran, long_prompt, short_prompt, predictor, rec))
        ctx.dim(f"urgent: {arm} done")
        free_memory(ctx)
    rec["rows"] = rows
    columns = ("policy / granularity", "trials", "urgent TTFT ms", "met SLO", "long TTFT ms")
    table = new_table(
        f"Urgent {short_n}-token prompt {delay_s * 1e3:.0f} ms into a {long_n}-token prefill "
        "(medians)",
        (*columns, "preemptions", "blocking mean ms"),
    )
    for row in rows:
        blocking = row["blocking_mean_ms"]
        table.add_row(
            row["arm"],
            str(row["trials"]),
            f"{row['urgent_ttft_ms']:.1f}",
            f"{row['urgent_met_slo']}/{row['trials']}",
            f"{row['long_ttft_ms']:.1f}",
            str(row["preemptions"]),
            "-" if blocking is None else f"{blocking:.2f}",
        )
    ctx.console.print(table)
    ctx.console.print(
        f"[dim]alone: long {alone['long'] * 1e3:.1f} ms, short {alone['short'] * 1e3:.1f} ms; "
        f"SLOs: urgent {urgent_slo:.2f} s, long {long_slo:.1f} s; batching none; predictor "
        "fitted on this run's prefill times[/dim]"
    )


def trials(
    ctx: Context,
    arm: str,
    policy: str,
    granularity: str,
    long_prompt: list[int],
    short_prompt: list[int],
    predictor: TTFTPredictor,
    rec: dict[str, Any],
) -> dict[str, Any]:
    urgent_ttft, long_ttft, met, preemptions = [], [], 0, 0
    timeout_s = 60 + 20 * rec["alone_long_s"]
    with (
        executor_for(ctx, granularity) as ex,
        PrefillEngine(ex, predictor, policy=policy, batching="none") as engine,
    ):
        for _ in range(ctx.plan.urgent_trials):
            long_f = engine.submit(long_prompt, ttft_slo_s=rec["long_slo_s"], slo_class="file")
            time.sleep(rec["urgent_arrives_after_s"])
            urgent_f = engine.submit(short_prompt, ttft_slo_s=rec["urgent_slo_s"], slo_class="chat")
            urgent, long = urgent_f.result(timeout_s), long_f.result(timeout_s)
            urgent_ttft.append(urgent.ttft_s)
            long_ttft.append(long.ttft_s)
            met += urgent.met_slo
            preemptions += long.num_preemptions
        blocking_ms = [b * 1e3 for b in engine.blocking_times_s]
    return {
        "arm": arm,
        "trials": len(urgent_ttft),
        "urgent_ttft_ms": statistics.median(urgent_ttft) * 1e3,
        "urgent_ttft_all_ms": [t * 1e3 for t in urgent_ttft],
        "urgent_met_slo": met,
        "long_ttft_ms": statistics.median(long_ttft) * 1e3,
        "preemptions": preemptions,
        "blocking_mean_ms": statistics.fmean(blocking_ms) if blocking_ms else None,
    }
