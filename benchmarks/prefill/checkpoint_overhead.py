"""Cost of the preemption checkpoints: prefill throughput with checks vs without hooks.

Same inputs, interleaved repeats in ABBA order (so slow drift of the machine hits both
arms equally): arm ``none`` has no hooks and no active task; arm ``operator`` has the
operator-granularity hooks installed and an active ``TaskControl`` that counts every
checkpoint (never signalled). Reports tokens/s per arm and the slowdown from the median of
the per-round time ratios (goal: under 2%), for wall time and for process CPU time (the
latter is steadier when other jobs share the machine).

    python benchmarks/prefill/checkpoint_overhead.py              # demo-llama, 4 × 1024 tokens
    python benchmarks/prefill/checkpoint_overhead.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import PreTrainedModel

from flowprefill.models import build_named, load_model, model_names
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor

ARMS = ("none", "operator")
CLOCKS = ("wall", "cpu")


def load(name_or_path: str) -> PreTrainedModel:
    if name_or_path in model_names():
        return build_named(name_or_path)
    return load_model(name_or_path)


def timed_prefill(
    model: PreTrainedModel, arm: str, prompts: list[torch.Tensor]
) -> dict[str, float]:
    """One prefill in ``arm``; hooks are installed before and removed after the timing."""
    with PreemptibleExecutor(model, granularity=arm) as executor:
        control = TaskControl(arm) if arm != "none" else None
        wall, cpu = time.perf_counter(), time.process_time()
        executor.run(prompts, control)
        elapsed = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
        if control is not None:  # the checks really ran
            lengths = [len(p) for p in prompts]
            assert control.num_checkpoints == executor.expected_checkpoints(lengths)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-llama", help="built-in name or local path")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per prompt")
    parser.add_argument("--batch", type=int, default=4, help="prompts per prefill")
    parser.add_argument("--repeats", type=int, default=12, help="ABBA rounds (4 runs each)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--quick", action="store_true", help="1 × 1024 tokens, 3 rounds")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.repeats = 1, 3
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=140)
    model = load(args.model)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, model.config.vocab_size, (args.tokens,), generator=gen)
        for _ in range(args.batch)
    ]
    num_tokens = args.tokens * args.batch
    console.print(
        f"model {args.model}, {args.batch} × {args.tokens} tokens, "
        f"{torch.get_num_threads()} threads, {args.repeats} ABBA rounds"
    )
    for arm in ARMS:  # warm-up: allocator, oneDNN primitive caches
        timed_prefill(model, arm, prompts)
    times: dict[tuple[str, str], list[float]] = {(a, c): [] for a in ARMS for c in CLOCKS}
    ratios: dict[str, list[float]] = {clock: [] for clock in CLOCKS}
    for round_index in range(args.repeats):
        order = ARMS if round_index % 2 == 0 else ARMS[::-1]
        total = {(arm, clock): 0.0 for arm in ARMS for clock in CLOCKS}
        for arm in (*order, *order[::-1]):  # A B B A
            for clock, value in timed_prefill(model, arm, prompts).items():
                times[arm, clock].append(value)
                total[arm, clock] += value
        for clock in CLOCKS:
            ratios[clock].append(total["operator", clock] / total["none", clock])
        console.print(
            f"[dim]round {round_index + 1}: wall none {total['none', 'wall'] / 2:.3f} s, "
            f"operator {total['operator', 'wall'] / 2:.3f} s[/dim]"
        )
    table = Table(title="Prefill with and without preemption checkpoints")
    for column in ("arm", "runs", "median wall s", "min wall s", "tokens/s", "median cpu s"):
        table.add_column(column, justify="right")
    for arm in ARMS:
        wall = times[arm, "wall"]
        table.add_row(
            arm,
            str(len(wall)),
            f"{statistics.median(wall):.3f}",
            f"{min(wall):.3f}",
            f"{num_tokens / statistics.median(wall):,.0f}",
            f"{statistics.median(times[arm, 'cpu']):.3f}",
        )
    console.print(table)
    for clock in CLOCKS:
        slowdown = (statistics.median(ratios[clock]) - 1) * 100
        spread = statistics.pstdev(ratios[clock]) * 100
        best = (min(times["operator", clock]) / min(times["none", clock]) - 1) * 100
        console.print(
            f"slowdown with checkpoints ({clock} time): {slowdown:+.2f}% median of per-round "
            f"ratios (spread ±{spread:.1f}%), {best:+.2f}% best vs best"
        )


if __name__ == "__main__":
    main()
