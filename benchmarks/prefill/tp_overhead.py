"""Tensor parallelism on CPU: the rank agreement's cost, checkpoint overhead, blocking, speed.

Three measurements, each with variants interleaved repeat by repeat so that they share the
machine's conditions:

1. **Agreement per checkpoint** (two processes): what one checkpoint costs a rank under the
   shared-memory target protocol the engine uses (``SharedTable.arrive``: a lock and two
   words) against the per-checkpoint all-reduce of the leader's flag (the textbook
   synchronised counter, gloo over loopback).
2. **Prefill time and checkpoint overhead**: one prompt of ``--tokens`` on TP=1 (all cores
   in one process) and TP=2 (the cores split between two ranks), each at granularity
   ``none`` (no checkpoints) and ``operator``. Overhead = operator / none − 1.
3. **Preemption blocking** at operator granularity: signal at a uniform moment of a
   prefill, time until the instance ACKs (for TP=2: until *every* rank has parked),
   resume at once.

    python benchmarks/prefill/tp_overhead.py                     # demo-llama, 2048 tokens
    python benchmarks/prefill/tp_overhead.py --quick             # tiny-llama, a short run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import track
from rich.table import Table

from flowprefill.contracts import EngineConfig
from flowprefill.prefill.executor.context import activate
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.factory import build_backend
from flowprefill.prefill.tp.agreement import SharedTable
from flowprefill.prefill.tp.ranks import free_port


def _agreement_worker(rank: int, port: int, table: SharedTable, iters: int, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    flag = torch.zeros(1, dtype=torch.int32)
    results: dict[str, list[float]] = {"shared table": [], "all-reduce": []}
    for _ in range(5):  # interleaved repeats
        dist.barrier()
        t0 = time.perf_counter()
        for k in range(1, iters + 1):
            table.arrive(0, rank, k, propose=False)
        results["shared table"].append((time.perf_counter() - t0) / iters * 1e6)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        results["all-reduce"].append((time.perf_counter() - t0) / iters * 1e6)
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def agreement_cost(iters: int) -> dict[str, list[float]]:
    ctx = multiprocessing.get_context("spawn")
    table = SharedTable(2, ctx=ctx)
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_agreement_worker, args=(r, port, table, iters, queue)) for r in range(2)
    ]
    for p in procs:
        p.start()
    results: dict[str, list[float]] = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    return results


class Variant:
    """One engine configuration: a TP=1 executor or a TP=2 backend."""

    def __init__(self, model: str, tp: int, granularity: str, threads: int) -> None:
        self.name = f"TP={tp} {granularity}"
        self.tp, self.threads = tp, threads
        config = EngineConfig(
            model_path=model,
            tp_size=tp,
            granularity=granularity,
            num_threads=max(1, threads // tp),
        )
        self.backend = build_backend(config)
        self.prefill_s: list[float] = []
        self.blocking_ms: list[float] = []

    def _threads(self) -> None:
        # Rank 0 shares this process with the TP=1 variants: set its thread count per run.
        torch.set_num_threads(max(1, self.threads // self.tp))

    def prefill(self, prompt: list[int]) -> float:
        self._threads()
        t0 = time.perf_counter()
        self.backend.run([prompt], TaskControl("bench"))
        return time.perf_counter() - t0

    def preempted_prefill(self, prompt: list[int], expected_s: float, rng: random.Random) -> float:
        """Run ``prompt``, preempt at a uniform moment, resume at once; blocking ms."""
        self._threads()
        control = TaskControl("bench")
        done = threading.Event()

        def main() -> None:
            with activate(control):
                self.backend.run([prompt], control)
            control.mark_done()
            done.set()

        thread = threading.Thread(target=main, daemon=True)
        thread.start()
        time.sleep(rng.uniform(0.05, 0.9) * expected_s)
        parked, blocking_s = control.request_preempt(timeout_s=120)
        if parked:
            control.resume()
        thread.join(300)
        return blocking_s * 1e3 if parked else float("nan")

    def close(self) -> None:
        self.backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-llama")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=6, help="prefills per variant")
    parser.add_argument("--preemptions", type=int, default=20, help="per TP degree")
    parser.add_argument("--iters", type=int, default=2000, help="checkpoints per agreement run")
    parser.add_argument("--threads", type=int, default=2, help="cores shared by the ranks")
    parser.add_argument("--quick", action="store_true", help="tiny-llama, few repeats")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.model, args.tokens, args.repeats = "tiny-llama", 512, 2
        args.preemptions, args.iters = 4, 300
    console = Console()

    with console.status("agreement cost per checkpoint (2 processes)"):
        agreement = agreement_cost(args.iters)
    table = Table(title="Rank agreement, µs per checkpoint per rank (5 interleaved repeats)")
    for col in ("protocol", "mean", "min", "max"):
        table.add_column(col, justify="right" if col != "protocol" else "left")
    for name, values in agreement.items():
        table.add_row(
            name, f"{statistics.mean(values):.1f}", f"{min(values):.1f}", f"{max(values):.1f}"
        )
    console.print(table)

    # One TP=2 instance per process at a time (rank 0 joins the default process group),
    # so TP=2 runs in two phases, one per granularity; both TP=1 variants run in each
    # phase, and TP=2 is compared with TP=1 of the same phase (ratios absorb drift).
    with console.status(f"loading {args.model} at TP=1"):
        tp1 = {g: Variant(args.model, 1, g, args.threads) for g in ("none", "operator")}
    gen = torch.Generator().manual_seed(0)
    vocab = tp1["none"].backend.vocab_size
    prompt = torch.randint(0, vocab, (args.tokens,), generator=gen).tolist()
    rng = random.Random(0)
    phases: dict[str, dict[str, Variant]] = {}
    for granularity in ("operator", "none"):
        with console.status(f"loading {args.model} at TP=2, granularity {granularity}"):
            tp2 = Variant(args.model, 2, granularity, args.threads)
        fresh = {g: Variant.__new__(Variant) for g in tp1}
        for g, v in tp1.items():  # the same TP=1 engines, fresh samples per phase
            fresh[g].__dict__.update(v.__dict__, prefill_s=[], blocking_ms=[])
        variants = {**{f"TP=1 {g}": fresh[g] for g in tp1}, "TP=2": tp2}
        for v in variants.values():
            v.prefill(prompt)  # warm-up
        for _ in track(range(args.repeats), description=f"prefill ({granularity})"):
            for v in variants.values():
                v.prefill_s.append(v.prefill(prompt))
        if granularity == "operator":
            pair = [variants["TP=1 operator"], tp2]
            for _ in track(range(args.preemptions), description="blocking"):
                for v in pair:
                    blocked = v.preempted_prefill(prompt, statistics.median(v.prefill_s), rng)
                    if blocked == blocked:  # not NaN: it parked before finishing
                        v.blocking_ms.append(blocked)
        tp2.close()
        phases[granularity] = variants

    def med(phase: str, name: str) -> float:
        return statistics.median(phases[phase][name].prefill_s)

    def blocking(v: Variant) -> str:
        b = sorted(v.blocking_ms)
        return f"mean {statistics.mean(b):.2f} / max {b[-1]:.2f} (n={len(b)})" if b else "-"

    # Prefill time of each variant relative to TP=1 none of the same phase.
    rel = {
        "TP=1 none": 1.0,
        "TP=1 operator": med("operator", "TP=1 operator") / med("operator", "TP=1 none"),
        "TP=2 operator": med("operator", "TP=2") / med("operator", "TP=1 none"),
        "TP=2 none": med("none", "TP=2") / med("none", "TP=1 none"),
    }
    base_ms = med("operator", "TP=1 none") * 1e3
    table = Table(title=f"{args.model}, {args.tokens} tokens, {args.threads} cores")
    for col in ("variant", "prefill ms", "vs TP=1 none", "checkpoint overhead", "blocking ms"):
        table.add_column(col, justify="right" if col != "variant" else "left")
    overhead = {
        "TP=1 operator": rel["TP=1 operator"] - 1,
        "TP=2 operator": rel["TP=2 operator"] / rel["TP=2 none"] - 1,
    }
    preempted = {
        "TP=1 operator": phases["operator"]["TP=1 operator"],
        "TP=2 operator": phases["operator"]["TP=2"],
    }
    for name, r in rel.items():
        table.add_row(
            name,
            f"{r * base_ms:.0f}",
            f"{r:.2f}×",
            f"{overhead[name]:+.1%}" if name in overhead else "",
            blocking(preempted[name]) if name in preempted else "",
        )
    console.print(table)
    console.print(
        f"TP=2 / TP=1 prefill time at operator granularity: "
        f"{rel['TP=2 operator'] / rel['TP=1 operator']:.2f}×"
    )
    figures: dict[str, Any] = {
        "agreement_us": agreement,
        "relative_prefill_time": rel,
        "checkpoint_overhead": overhead,
        "blocking_ms": {k: v.blocking_ms for k, v in preempted.items()},
        "prefill_s": {
            f"{phase}: {name}": v.prefill_s
            for phase, variants in phases.items()
            for name, v in variants.items()
        },
    }
    for v in tp1.values():
        v.close()
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
        console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
