"""Preemption blocking time (signal → ACK) at operator vs layer granularity.

A prefill of one long prompt runs on a task thread; a scheduler thread raises the
preemption signal at random moments, records how long ``request_preempt`` blocked until the
task parked, and resumes it at once. Granularities alternate prefill by prefill so both see
the same machine conditions. Prints mean / p50 / p99 / max per granularity and the
layer / operator ratios (the paper reports operator level 3.5–4.2× lower).

Signal moments are uniform over the prefill's *execution* time (wall time minus time
parked): one per stratum of ``spacing`` ms, with ``spacing`` three times the longest
checkpoint-to-checkpoint segment, so a signal's phase within a segment is uniform. (Waiting
a random time after each resume instead would put signals near segment starts — right after
the checkpoint the task resumed from — and overstate blocking.) A moment that falls inside
the previous blocking interval is skipped.

    python benchmarks/prefill/preemption_blocking.py                 # demo-llama, 2048 tokens
    python benchmarks/prefill/preemption_blocking.py --quick         # a short run
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table
from transformers import PreTrainedModel

from flowprefill.models import build_named, load_model, model_names
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor


@dataclass
class Samples:
    blocking_ms: list[float] = field(default_factory=list)
    num_skipped: int = 0  # moments that fell inside the previous blocking interval
    num_prefills: int = 0
    prefill_s: list[float] = field(default_factory=list)


def load(name_or_path: str) -> PreTrainedModel:
    if name_or_path in model_names():
        return build_named(name_or_path)  # in memory, no cache directory needed
    return load_model(name_or_path)


class Stopwatch(TaskControl):
    """Records when each checkpoint is reached (never signalled)."""

    def __init__(self) -> None:
        super().__init__("stopwatch")
        self.times_s: list[float] = []

    def check(self) -> None:
        self.times_s.append(time.perf_counter())
        super().check()


def segment_model(
    executor: PreemptibleExecutor, prompt: torch.Tensor, runs: int = 5
) -> tuple[float, float]:
    """Blocking predicted from uninterrupted prefills: segment durations d between
    checkpoints (median over ``runs`` per segment) give mean Σd²/(2Σd) for a signal at a
    uniformly random moment (it falls in long segments more often) and max = longest d."""
    per_run: list[list[float]] = []
    for _ in range(runs):
        watch = Stopwatch()
        start = time.perf_counter()
        executor.run([prompt], watch)
        marks = [start, *watch.times_s, time.perf_counter()]
        per_run.append([b - a for a, b in itertools.pairwise(marks)])
    segments = [statistics.median(column) for column in zip(*per_run, strict=True)]
    expected = sum(d * d for d in segments) / (2 * sum(segments))
    return expected * 1e3, max(segments) * 1e3


def one_prefill(
    executor: PreemptibleExecutor, prompt: torch.Tensor, spacing_s: float, rng: random.Random
) -> tuple[list[float], int, float]:
    """One prefill preempted at random moments; returns (blocking ms, skipped, wall s)."""
    control = TaskControl("bench")
    failure: list[BaseException] = []

    def task() -> None:
        try:
            executor.run([prompt], control)
        except BaseException as err:  # surfaced below
            failure.append(err)
        finally:
            control.mark_done()

    thread = threading.Thread(target=task, daemon=True)
    blocking_ms: list[float] = []
    skipped = 0
    parked_s = 0.0
    start = time.perf_counter()
    thread.start()
    for stratum in itertools.count():
        target_s = (stratum + rng.random()) * spacing_s  # on the execution clock
        now_s = time.perf_counter() - start - parked_s
        if target_s < now_s:
            skipped += 1
            continue
        time.sleep(target_s - now_s)
        parked, blocking_s = control.request_preempt(timeout_s=120.0)
        if not parked:
            break  # the prefill finished first
        blocking_ms.append(blocking_s * 1e3)
        acked = time.perf_counter()
        control.resume()
        # TaskControl clears ``parked`` on the task thread after it wakes; a signal
        # raised before that would be refused as "already preempted".
        while control.parked:
            time.sleep(0)
        parked_s += time.perf_counter() - acked
    thread.join()
    if failure:
        raise failure[0]
    return blocking_ms, skipped, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-llama", help="built-in name or local path")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length")
    parser.add_argument("--samples", type=int, default=150, help="samples per granularity")
    parser.add_argument("--granularities", nargs="+", default=["operator", "layer"])
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--spacing-ms", type=float, default=None, help="override the strata")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1024 tokens, 40 samples")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.samples = min(args.tokens, 1024), 40
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=140)
    model = load(args.model)
    rng = random.Random(args.seed)
    prompt = torch.randint(
        0, model.config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(1)
    )
    predicted: dict[str, tuple[float, float]] = {}
    spacing_s: dict[str, float] = {}
    for granularity in args.granularities:
        with PreemptibleExecutor(model, granularity=granularity, chunk_size=args.chunk_size) as ex:
            ex.run([prompt])  # warm-up: first-call kernel setup would skew the segments
            predicted[granularity] = segment_model(ex, prompt)
        spacing_ms = args.spacing_ms or 3 * predicted[granularity][1]
        spacing_s[granularity] = spacing_ms / 1e3
    console.print(
        f"model {args.model}, {args.tokens} tokens, {torch.get_num_threads()} threads; "
        "signal strata: " + ", ".join(f"{g} {s * 1e3:.0f} ms" for g, s in spacing_s.items())
    )
    samples = {g: Samples() for g in args.granularities}
    while any(len(s.blocking_ms) < args.samples for s in samples.values()):
        for granularity, bucket in samples.items():
            if len(bucket.blocking_ms) >= args.samples:
                continue
            with PreemptibleExecutor(
                model, granularity=granularity, chunk_size=args.chunk_size
            ) as executor:
                got, skipped, wall_s = one_prefill(executor, prompt, spacing_s[granularity], rng)
            bucket.blocking_ms.extend(got)
            bucket.num_skipped += skipped
            bucket.num_prefills += 1
            bucket.prefill_s.append(wall_s)
        done = {g: len(s.blocking_ms) for g, s in samples.items()}
        console.print(f"[dim]samples so far: {done}[/dim]")
    report(console, samples, args.samples, predicted)


def summary(values: list[float]) -> tuple[float, float, float, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.fmean(values), statistics.median(values), p99, ordered[-1]


def report(
    console: Console,
    samples: dict[str, Samples],
    limit: int,
    predicted: dict[str, tuple[float, float]],
) -> None:
    table = Table(title="Preemption blocking time (signal → ACK)")
    columns = (
        "granularity",
        "samples",
        "mean ms",
        "p50 ms",
        "p99 ms",
        "max ms",
        "prefills",
        "wall s",
        "model mean/max ms",
    )
    for column in columns:
        table.add_column(column, justify="right")
    stats = {}
    for granularity, bucket in samples.items():
        values = bucket.blocking_ms[:limit]
        stats[granularity] = summary(values)
        mean, p50, p99, worst = stats[granularity]
        table.add_row(
            granularity,
            str(len(values)),
            f"{mean:.2f}",
            f"{p50:.2f}",
            f"{p99:.2f}",
            f"{worst:.2f}",
            str(bucket.num_prefills),
            f"{statistics.median(bucket.prefill_s):.2f}",
            "{:.2f} / {:.2f}".format(*predicted[granularity]),
        )
    console.print(table)
    console.print(
        "[dim]wall s: median prefill wall time including the preemptions. model: blocking "
        "predicted from uninterrupted prefills' checkpoint-to-checkpoint times "
        "(mean Σd²/2Σd, max = longest segment)[/dim]"
    )
    if "operator" in stats and "layer" in stats:
        op, layer = stats["operator"], stats["layer"]
        console.print(
            "layer / operator ratio: "
            f"mean {layer[0] / op[0]:.2f}×, p50 {layer[1] / op[1]:.2f}×, "
            f"p99 {layer[2] / op[2]:.2f}×, max {layer[3] / op[3]:.2f}×"
        )


if __name__ == "__main__":
    main()
