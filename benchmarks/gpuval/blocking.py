"""Section 3: preemption blocking time (signal → ACK) by granularity, sampled at random
moments of a long prefill as benchmarks/prefill/preemption_blocking.py does; on CUDA every ACK is
also checked to leave the task's stream idle."""

from __future__ import annotations

import itertools
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.gpuval.common import (
    Context,
    Probe,
    TaskThread,
    executor_for,
    memory_note,
    new_table,
    percentile,
)
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor


def segment_model(
    ctx: Context, ex: PreemptibleExecutor, prompt: torch.Tensor, runs: int
) -> tuple[float, float, float]:
    """Uninterrupted prefills timed at every checkpoint (host clock; with every_check the
    stream was synchronised just before): predicted mean blocking Σd²/2Σd ms for a signal
    at a uniformly random moment, the longest segment ms, and the prefill's seconds."""
    per_run: list[list[float]] = []
    walls = []
    for _ in range(runs):
        watch = Probe("stopwatch", cuda=False)
        ctx.sync()
        start = time.perf_counter()
        ex.run([prompt], watch)
        end = time.perf_counter()
        walls.append(end - start)
        per_run.append([b - a for a, b in itertools.pairwise([start, *watch.times_s, end])])
    segments = [statistics.median(column) for column in zip(*per_run, strict=True)]
    mean_s = sum(d * d for d in segments) / (2 * sum(segments))
    return mean_s * 1e3, max(segments) * 1e3, statistics.median(walls)


@dataclass
class Sampled:
    """What the preempted prefills of one granularity gave."""

    blocking_ms: list[float] = field(default_factory=list)
    done_first_ms: list[float] = field(default_factory=list)
    """Waits for a signal the prefill finished before acknowledging (not blocking samples:
    the end of the forward has no checkpoint; with on_preempt the whole queued tail)."""
    busy_after_ack: int = 0
    prefills: int = 0


def one_preempted_prefill(
    ctx: Context,
    ex: PreemptibleExecutor,
    prompt: torch.Tensor,
    spacing_s: float,
    rng: random.Random,
    into: Sampled,
) -> None:
    """One prefill signalled at moments uniform over its *execution* time (one per stratum
    of ``spacing_s``; parked time excluded), resumed at once after each ACK; on CUDA each
    ACK must find the task's stream idle."""
    control = Probe("bench", ctx.cuda)
    task = TaskThread(ex, [prompt], control)
    parked_s = 0.0
    start = time.perf_counter()
    task.start()
    for stratum in itertools.count():
        target_s = (stratum + rng.random()) * spacing_s
        now_s = time.perf_counter() - start - parked_s
        if target_s < now_s:
            continue  # fell inside the previous blocking interval
        time.sleep(target_s - now_s)
        parked, blocking_s = control.request_preempt(timeout_s=300.0)
        if not parked:  # the prefill finished first
            if blocking_s > 0:
                into.done_first_ms.append(blocking_s * 1e3)
            break
        into.blocking_ms.append(blocking_s * 1e3)
        if ctx.cuda and not control.stream_idle():
            into.busy_after_ack += 1
        acked = time.perf_counter()
        control.resume()
        while control.parked:  # cleared on the task thread once it wakes
            time.sleep(0)
        parked_s += time.perf_counter() - acked
    task.join()
    into.prefills += 1


def section_blocking(ctx: Context, rec: dict[str, Any], deadline: float) -> None:
    grans = [arm for arm in ctx.arms if arm != "none"]
    notes: list[str] = rec.setdefault("notes", [])
    # Per granularity: a warm-up, the segment runs and a few preempted prefills.
    seconds = deadline - time.perf_counter()
    n, note = ctx.fit_tokens(ctx.plan.blocking_tokens, 10 * len(grans), seconds)
    if note is not None:
        notes.append(note)
    rec.update(tokens=n, target_samples=ctx.plan.blocking_samples)
    reason = memory_note(ctx, n)
    if reason is not None:
        rec.update(status="skipped", reason=reason)
        return
    prompt = ctx.prompt(n, seed=2)
    stats: dict[str, tuple[float, float, float]] = {}
    for g in grans:
        if time.perf_counter() > deadline:
            notes.append(f"{g}: not measured (budget)")
            continue
        with executor_for(ctx, g) as ex:
            ex.run([prompt], TaskControl("warm-up"))
            stats[g] = segment_model(ctx, ex, prompt, runs=2 if ctx.args.quick else 3)
    sampled = sample(ctx, prompt, stats, notes, deadline)
    rows = []
    for g, got in sampled.items():
        model_mean, longest, wall_s = stats[g]
        values = got.blocking_ms
        row: dict[str, Any] = {
            "granularity": g,
            "samples": len(values),
            "prefills": got.prefills,
            "prefill_s": wall_s,
            "model_mean_ms": model_mean,
            "model_max_ms": longest,
            "done_first_ms": got.done_first_ms,
        }
        if values:
            row["mean_ms"] = statistics.fmean(values)
            row["p50_ms"] = statistics.median(values)
            row["p99_ms"] = percentile(values, 0.99)
            row["max_ms"] = max(values)
        if ctx.cuda:
            row["busy_after_ack"] = got.busy_after_ack
            if got.busy_after_ack:
                rec["status"] = "failed"
                notes.append(f"{g}: {got.busy_after_ack} ACKs found the stream still busy")
        rows.append(row)
    rec["rows"] = rows
    report(ctx, rec, rows, n)


def sample(
    ctx: Context,
    prompt: torch.Tensor,
    stats: dict[str, tuple[float, float, float]],
    notes: list[str],
    deadline: float,
) -> dict[str, Sampled]:
    """Preempted prefills, granularities in turn, until each has its samples, has run
    twice the prefills its strata should need (on_preempt yields few: signals after the
    host queued the whole forward wait for the end), or the budget is spent."""
    rng = random.Random(ctx.args.seed)
    sampled = {g: Sampled() for g in stats}
    target = ctx.plan.blocking_samples
    last_print = time.perf_counter()
    while True:
        progressed = False
        for g, got in sampled.items():
            _, longest_ms, wall_s = stats[g]
            # Strata at least one longest segment wide (a signal's phase within a segment
            # is then uniform), three where that leaves three or more per prefill, and no
            # more than ~50 per prefill.
            longest_s = longest_ms / 1e3
            spacing_s = max(longest_s, min(3 * longest_s, wall_s / 3), wall_s / 50)
            max_prefills = max(5, math.ceil(2 * target * spacing_s / wall_s))
            if len(got.blocking_ms) >= target or got.prefills >= max_prefills:
                continue
            if time.perf_counter() + 1.5 * wall_s > deadline:
                continue
            with executor_for(ctx, g) as ex:
                one_preempted_prefill(ctx, ex, prompt, spacing_s, rng, got)
            progressed = True
        if not progressed:
            break
        if time.perf_counter() - last_print > 2.0:
            last_print = time.perf_counter()
            counts = ", ".join(f"{g} {len(got.blocking_ms)}" for g, got in sampled.items())
            ctx.dim(f"blocking samples: {counts}")
    for g, got in sampled.items():
        if len(got.blocking_ms) < target:
            count = len(got.blocking_ms)
            notes.append(f"{g}: {count} of {target} samples in {got.prefills} prefills")
    return sampled


def report(ctx: Context, rec: dict[str, Any], rows: list[dict[str, Any]], n: int) -> None:
    columns = ["granularity", "samples", "mean ms", "p50 ms", "p99 ms", "max ms"]
    columns += ["model mean/max ms", "prefill s", "done first max ms"]
    columns += ["busy after ACK"] if ctx.cuda else []
    table = new_table(f"Preemption blocking time (signal → ACK), {n} tokens", columns)
    for row in rows:
        cells = [row["granularity"], str(row["samples"])]
        for key in ("mean_ms", "p50_ms", "p99_ms", "max_ms"):
            cells.append(f"{row[key]:.2f}" if key in row else "-")
        cells.append(f"{row['model_mean_ms']:.2f} / {row['model_max_ms']:.2f}")
        cells.append(f"{row['prefill_s']:.3f}")
        cells.append(f"{max(row['done_first_ms']):.1f}" if row["done_first_ms"] else "-")
        if ctx.cuda:
            cells.append(str(row["busy_after_ack"]))
        table.add_row(*cells)
    ctx.console.print(table)
    means = {row["granularity"]: row.get("mean_ms") for row in rows}
    layer, operator = means.get("layer"), means.get("operator")
    if layer and operator:
        rec["layer_over_operator_mean"] = layer / operator
        ctx.console.print(
            f"layer / operator mean blocking: {layer / operator:.2f}× (paper, A100: 3.5–4.2×; "
            "operator mean 2.6 ms, max < 4.5 ms)"
        )
    ctx.console.print(
        "[dim]model: predicted from uninterrupted prefills' checkpoint-to-checkpoint host "
        "times (not meaningful for on_preempt, whose host runs ahead of the GPU). done first: "
        "signals the prefill finished before acknowledging (no checkpoint after the last "
        "layer), waited for until the end[/dim]"
    )
