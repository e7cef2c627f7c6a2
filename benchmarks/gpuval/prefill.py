"""Section 2: prefill time of a plain forward vs the executor at each granularity;
checkpoint overhead, TFLOP/s and model FLOP utilisation."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from benchmarks.gpuval.common import (
    Context,
    executor_for,
    extrapolate_s,
    free_memory,
    memory_note,
    new_table,
    plain_forward,
    prefill_flops,
)
from flowprefill.prefill.executor.preemption import TaskControl


def timed_run(ctx: Context, arm: str, prompt: torch.Tensor) -> tuple[float, str | None]:
    """Seconds of one prefill of ``prompt`` in ``arm`` (device synchronised before and
    after; hooks installed outside the timing), and a note when the executor passed a
    different number of checkpoints than it predicted.

    Wall clock, not CUDA events: the executor runs on its own stream and its cost is the
    host's too (a sync per checkpoint), so every arm is timed the same way."""
    if arm == "plain":
        ctx.sync()
        start = time.perf_counter()
        int(plain_forward(ctx, prompt).argmax())  # the first token reaches the host
        ctx.sync()
        return time.perf_counter() - start, None
    with executor_for(ctx, arm) as ex:
        control = TaskControl(arm)  # as the engine runs it: per-checkpoint syncs active
        ctx.sync()
        start = time.perf_counter()
        outputs = ex.run([prompt], control)  # returns once the task's stream is drained
        ctx.sync()
        elapsed = time.perf_counter() - start
        del outputs
        expected = ex.expected_checkpoints([len(prompt)])
    if control.num_checkpoints == expected:
        return elapsed, None
    passed = control.num_checkpoints
    return elapsed, f"{arm}, {len(prompt)} tokens: {passed} checkpoints, {expected} predicted"


def section_prefill(ctx: Context, rec: dict[str, Any], deadline: float) -> None:
    arms = ["plain", *ctx.arms]
    rows: list[dict[str, Any]] = []
    notes: list[str] = rec.setdefault("notes", [])
    rec["rows"] = rows
    per_round: list[tuple[int, float]] = []  # (tokens, seconds for one round of all arms)
    for n in ctx.plan.sizes:
        if n > ctx.config.max_position_embeddings:
            notes.append(f"skipped {n} tokens: longer than max_position_embeddings")
            continue
        reason = memory_note(ctx, n)
        need_s = extrapolate_s(per_round, n, min_alpha=1.0) * (ctx.plan.repeats + 1)
        left_s = deadline - time.perf_counter()
        if reason is None and need_s > left_s:
            reason = f"~{need_s:.0f} s predicted, {left_s:.0f} s left in the budget"
        elif reason is not None:
            ctx.memory_limit_tokens = min(n, ctx.memory_limit_tokens or n)
        if reason is not None:
            notes.append(f"skipped {n} tokens: {reason}")
            continue
        try:
            times, ratios = time_size(ctx, arms, n, per_round, notes, deadline)
        except torch.cuda.OutOfMemoryError as err:
            notes.append(f"{n} tokens: out of memory ({str(err).splitlines()[0]})")
            ctx.memory_limit_tokens = n
            break
        finally:
            free_memory(ctx)
        if not times["plain"]:
            break
        ctx.prefill_samples.append((n, statistics.median(times["operator"])))
        rows += size_rows(ctx, n, times, ratios)
    rec["flops"] = (
        "2·tokens per decoder weight + 4·heads·head_dim per causal query-key pair per layer "
        "+ one lm_head row"
    )
    columns = ("tokens", "arm", "runs", "median ms", "min ms", "vs plain", "vs none")
    table = new_table(
        "Prefill time, checkpoint overhead, model FLOP utilisation",
        (*columns, "TFLOP/s", "MFU"),
    )
    for row in rows:
        vs_none = row["overhead_vs_none_pct"]
        mfu = row["mfu_pct"]
        table.add_row(
            str(row["tokens"]),
            row["arm"],
            str(row["runs"]),
            f"{row['median_ms']:.2f}",
            f"{row['min_ms']:.2f}",
            f"{row['overhead_vs_plain_pct']:+.2f}%",
            "" if vs_none is None else f"{vs_none:+.2f}%",
            f"{row['tflops']:.3f}",
            "n/a" if mfu is None else f"{mfu:.1f}%",
        )
    ctx.console.print(table)
    ctx.console.print(
        "[dim]vs plain / vs none: median of per-round time ratios (arms interleaved, order "
        "rotated each round); plain = model(input_ids, logits_to_keep=1) on the default "
        f"stream. Peak: {ctx.results['device']['peak_note']}[/dim]"
    )


def time_size(
    ctx: Context,
    arms: list[str],
    n: int,
    per_round: list[tuple[int, float]],
    notes: list[str],
    deadline: float,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Rounds of every arm at ``n`` tokens (round 0 warms up, untimed); per arm the
    seconds and the ratios to the same round's plain forward."""
    prompt = ctx.prompt(n)
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    ratios: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in range(ctx.plan.repeats + 1):
        started = time.perf_counter()
        got: dict[str, float] = {}
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
            got[arm], note = timed_run(ctx, arm, prompt)
            if note is not None and note not in notes:
                notes.append(note)
        if r == 0:
            continue  # first calls (kernel selection, allocator) would skew the estimates
        per_round.append((n, time.perf_counter() - started))
        for arm in arms:
            times[arm].append(got[arm])
            ratios[arm].append(got[arm] / got["plain"])
        ctx.dim(f"prefill {n} tokens: round {r}/{ctx.plan.repeats}")
        if r < ctx.plan.repeats and time.perf_counter() > deadline:
            notes.append(f"{n} tokens: stopped after {r} of {ctx.plan.repeats} rounds (budget)")
            break
    return times, ratios


def size_rows(
    ctx: Context, n: int, times: dict[str, list[float]], ratios: dict[str, list[float]]
) -> list[dict[str, Any]]:
    flops = prefill_flops(ctx.config, n)
    none_ratio = statistics.median(ratios["none"]) if "none" in ratios else None
    rows = []
    for arm, values in times.items():
        median_s = statistics.median(values)
        ratio = statistics.median(ratios[arm])
        rows.append(
            {
                "tokens": n,
                "arm": arm,
                "runs": len(values),
                "median_ms": median_s * 1e3,
                "min_ms": min(values) * 1e3,
                "overhead_vs_plain_pct": (ratio - 1) * 100,
                "overhead_vs_none_pct": (ratio / none_ratio - 1) * 100 if none_ratio else None,
                "tflops": flops / median_s / 1e12,
                "mfu_pct": 100 * flops / median_s / ctx.peak_flops if ctx.peak_flops else None,
            }
        )
    return rows
