"""Blocking bounded by time: run-time operator splitting on the CPU engine.

One long prompt (default 8K tokens of demo-llama) is prefilled uninterrupted at each bound
(``off`` = operators run whole, then each ``--bounds`` value in ms), repeats interleaved
round by round so drift of the machine hits every arm alike. A control timestamps every
checkpoint; from the stretches ``d`` between consecutive checkpoints:

* **max blocking** = the longest stretch (a signal just after a checkpoint waits all of it),
* **mean blocking** = Σd² / (2Σd) (a signal at a uniformly random moment falls in long
  stretches more often),
* **throughput cost** = prefill time at the bound / prefill time unsplit − 1, the median of
  per-round ratios (wall clock and process CPU time; the latter is steadier on a shared
  machine).

All arms predict with one set of measured rates (calibrated once), so arms differ only in
the bound.

    python benchmarks/prefill/bounded_blocking.py                        # demo-llama, 8192 tokens
    python benchmarks/prefill/bounded_blocking.py --quick                # tiny-llama, seconds
    python benchmarks/prefill/bounded_blocking.py --bounds 100 50 25 12 --repeats 5 --out runs/bb
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from transformers import PreTrainedModel

from flowprefill.models import build_named, load_model, model_names
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.executor.splitting import SplitRates

OFF = "off"


class Stopwatch(TaskControl):
    """Records when each checkpoint is reached (never signalled)."""

    def __init__(self) -> None:
        super().__init__("stopwatch")
        self.times_s: list[float] = []

    def check(self) -> None:
        self.times_s.append(time.perf_counter())
        super().check()


@dataclass
class Arm:
    label: str
    bound_ms: float | None
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    max_ms: list[float] = field(default_factory=list)
    mean_ms: list[float] = field(default_factory=list)
    checkpoints: int = 0


def load(name_or_path: str) -> PreTrainedModel:
    if name_or_path in model_names():
        return build_named(name_or_path)
    return load_model(name_or_path)


def one_run(executor: PreemptibleExecutor, prompt: torch.Tensor, arm: Arm) -> None:
    watch = Stopwatch()
    cpu0, start = time.process_time(), time.perf_counter()
    executor.run([prompt], watch)
    end, cpu1 = time.perf_counter(), time.process_time()
    marks = [start, *watch.times_s, end]
    stretches = [b - a for a, b in itertools.pairwise(marks)]
    arm.wall_s.append(end - start)
    arm.cpu_s.append(cpu1 - cpu0)
    arm.max_ms.append(max(stretches) * 1e3)
    arm.mean_ms.append(sum(d * d for d in stretches) / (2 * sum(stretches)) * 1e3)
    arm.checkpoints = watch.num_checkpoints


def cost_pct(arm: Arm, base: Arm, clock: str) -> float:
    mine, theirs = getattr(arm, f"{clock}_s"), getattr(base, f"{clock}_s")
    return (statistics.median(a / b for a, b in zip(mine, theirs, strict=True)) - 1) * 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-llama", help="built-in name or local path")
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length")
    parser.add_argument(
        "--bounds", nargs="+", type=float, default=[100.0, 50.0, 25.0, 12.0], help="ms"
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds (every arm once each)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--out", default=None, help="write results.json here")
    parser.add_argument("--quick", action="store_true", help="tiny-llama, 1024 tokens, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.model, args.tokens, args.repeats = "tiny-llama", 1024, 2
        args.bounds = [1.0, 0.25]
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console()
    model = load(args.model)
    prompt = torch.randint(0, int(model.config.vocab_size), (args.tokens,))
    with PreemptibleExecutor(model, max_blocking_ms=1.0) as probe:
        policy = probe.split_policy
        assert policy is not None
        rates: SplitRates = policy.rates
        probe.run([prompt])  # warm-up
    console.print(
        f"{args.model}, {args.tokens} tokens, {torch.get_num_threads()} threads; rates: GEMM "
        f"{rates.gemm_flop_per_s / 1e9:.0f} GFLOP/s, attention "
        f"{rates.attention_flop_per_s / 1e9:.0f} GFLOP/s"
    )
    arms = [Arm(OFF, None)] + [Arm(f"{b:g} ms", b) for b in args.bounds]
    with Progress(console=console, transient=True) as progress:
        bar = progress.add_task("prefills", total=args.repeats * len(arms))
        for _round in range(args.repeats):
            for arm in arms:
                with PreemptibleExecutor(
                    model, max_blocking_ms=arm.bound_ms, split_rates=rates
                ) as executor:
                    one_run(executor, prompt, arm)
                progress.advance(bar)
    base = arms[0]
    table = Table(title=f"bounded blocking: {args.model}, {args.tokens}-token prefill")
    for column in (
        "bound",
        "checkpoints",
        "prefill s",
        "max blocking ms",
        "mean blocking ms",
        "cost wall %",
        "cost cpu %",
    ):
        table.add_column(column, justify="right")
    for arm in arms:
        table.add_row(
            arm.label,
            str(arm.checkpoints),
            f"{statistics.median(arm.wall_s):.2f}",
            f"{statistics.median(arm.max_ms):.1f} ({min(arm.max_ms):.1f}-{max(arm.max_ms):.1f})",
            f"{statistics.median(arm.mean_ms):.1f}",
            "-" if arm is base else f"{cost_pct(arm, base, 'wall'):+.1f}",
            "-" if arm is base else f"{cost_pct(arm, base, 'cpu'):+.1f}",
        )
    console.print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        payload = {
            "model": args.model,
            "tokens": args.tokens,
            "threads": torch.get_num_threads(),
            "rates": asdict(rates),
            "arms": [asdict(arm) for arm in arms],
        }
        (out / "results.json").write_text(json.dumps(payload, indent=2))
        console.print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
