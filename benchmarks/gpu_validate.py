"""One command that validates the prefill engine on a GPU (and smoke-runs on CPU).

Sections, each with a share of one time budget (``--budget-s``: what does not fit is
skipped with a note; every section prints its elapsed time), one module each under
``benchmarks/gpuval/``:

1. ``checks`` — CUDA-only correctness on the real model: each task on a stream of its own,
   the stream idle at every checkpoint (``every_check``), a parked task leaves no queued
   kernels (also with ``run_ahead`` and ``on_preempt``, where work *is* queued when it
   parks), resumed
   prefills bit-identical; plus pytest of tests/prefill/executor/test_device.py. On CPU the stream
   checks are reported as skipped.
2. ``prefill`` — prefill time (GPU: 512 / 2K / 8K / 32K tokens) of a plain forward and of
   the executor at each granularity (none, layer, operator, operator with run-time splitting
   when this build has it, operator with ``sync="run_ahead"`` (1 and 2 operators) and
   ``sync="on_preempt"`` on CUDA; ``--arms`` picks a subset): checkpoint
   overhead %, TFLOP/s, MFU against the GPU's dense bf16 peak.
3. ``blocking`` — signal → ACK time at random moments of a long prefill, by granularity.
4. ``operators`` — per-operator times over a token sweep (CUDA events / perf_counter) as the
   simulator's vidur-format calibration CSV, parsed back by ``flowprefill.lab.sim.vidur``.
5. ``urgent`` — TTFT of an urgent short prompt behind a long one through the real engine:
   S-EDF with preemption vs FCFS.

    python benchmarks/gpu_validate.py                                 # CUDA: Llama-3-8B shape
    python benchmarks/gpu_validate.py --device cpu --model tiny --quick   # CI-sized

Writes ``results.json`` (rewritten after every section) and the calibration CSV to
``--out``. Exit status 1 when a check failed or a section raised, 2 when it could not
start. docs/gpu.md: how to run it on a GPU machine, and what it measured on an H100.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import transformers

# Run as a script: the repository root goes on the path so that ``benchmarks`` imports as a
# package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console

from benchmarks.gpuval.blocking import section_blocking
from benchmarks.gpuval.checks import section_checks, start_device_tests
from benchmarks.gpuval.common import (
    ARM_KWARGS,
    ROOT,
    SHAPES,
    START_S,
    Budget,
    Context,
    build_model,
    free_memory,
    peak_for,
    plan_for,
    split_unsupported_reason,
)
from benchmarks.gpuval.operators import section_operators
from benchmarks.gpuval.prefill import section_prefill
from benchmarks.gpuval.urgent import section_urgent

SECTIONS: dict[str, Callable[[Context, dict[str, Any], float], None]] = {
    "checks": section_checks,
    "prefill": section_prefill,
    "blocking": section_blocking,
    "operators": section_operators,
    "urgent": section_urgent,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--device", choices=("cuda", "cpu"), help="default: cuda when torch sees one")
    add("--model", choices=tuple(SHAPES), help="default: llama3-8b on cuda, tiny on cpu")
    add("--layers", type=int, help="decoder layers (default: the model's; fewer is faster)")
    add("--dtype", choices=("bfloat16", "float16", "float32"), help="default: bf16 / fp32 on cpu")
    add("--out", type=Path, default=ROOT / "runs" / "gpu_validate", help="output directory")
    add("--quick", action="store_true", help="small sizes (CI, a first smoke run)")
    add("--sections", nargs="+", choices=tuple(SECTIONS), default=list(SECTIONS))
    add("--sizes", type=int, nargs="+", help="prefill token counts")
    add("--repeats", type=int, help="timed rounds per prefill size")
    add("--budget-s", type=float, help="the whole run, seconds (default 500 on cuda)")
    add(
        "--arms",
        nargs="+",
        choices=tuple(ARM_KWARGS),
        help="executor arms to time (default: all this device supports)",
    )
    add("--max-blocking-ms", type=float, default=4.0, help="bound of the operator+split arm")
    add("--peak-tflops", type=float, help="override the peak used for MFU")
    add("--no-pytest", action="store_true", help="do not run the device tests")
    add("--threads", type=int, help="torch CPU threads")
    add("--seed", type=int, default=0)
    return parser.parse_args(argv)


def device_info(device: torch.device, dtype: torch.dtype, peak_note: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "type": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peak_note": peak_note,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
        slug = props.name.lower().removeprefix("nvidia ").split()[0]
    else:
        info.update(name="cpu", threads=torch.get_num_threads())
        slug = "cpu"
    info["slug"] = "".join(ch for ch in slug if ch.isalnum() or ch in "-_") or device.type
    return info


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def write_results(ctx: Context) -> None:
    text = json.dumps(ctx.results, indent=2, default=str)
    (ctx.out / "results.json").write_text(text + "\n")


def run_section(ctx: Context, name: str) -> None:
    """One section: its budget, its record in results.json, errors caught (the other
    sections still run) and device memory freed afterwards."""
    deadline, seconds = ctx.budget.begin(name)
    ctx.console.rule(f"[bold]{name}[/bold] (budget {seconds:.0f} s)")
    rec: dict[str, Any] = {"status": "ok", "budget_s": round(seconds, 1)}
    ctx.results["sections"][name] = rec
    started = time.perf_counter()
    try:
        SECTIONS[name](ctx, rec, deadline)
    except Exception as err:
        rec.update(status="error", error=f"{type(err).__name__}: {err}")
        rec["traceback"] = traceback.format_exc()
        ctx.console.print(f"[red]{name} raised {type(err).__name__}: {err}[/red]")
        ctx.console.print(rec["traceback"], markup=False, highlight=False)
    finally:
        free_memory(ctx)
        rec["elapsed_s"] = round(time.perf_counter() - started, 2)
        write_results(ctx)
    for note in rec.get("notes", []):
        ctx.console.print(f"[yellow]note:[/yellow] {note}")
    ctx.console.print(
        f"{name}: {rec['status']} in {rec['elapsed_s']:.1f} s (budget {seconds:.0f} s; "
        f"{ctx.budget.elapsed_s():.0f} s since start)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sections; ``argv`` None reads the command line (and the budget counts from
    the import), otherwise the budget counts from this call (tests call it in-process)."""
    clock_start_s = START_S if argv is None else time.perf_counter()
    args = parse_args(argv)
    console = Console(width=150)
    if args.threads:
        torch.set_num_threads(args.threads)
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        console.print("[red]--device cuda, but torch sees no CUDA device[/red]")
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else None
    device = device or torch.device("cpu")
    model_name = args.model or ("llama3-8b" if device_type == "cuda" else "tiny")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device_type == "cuda" else "float32"))
    plan = plan_for(device_type, args.quick)
    plan.sizes = sorted(args.sizes) if args.sizes else plan.sizes
    plan.repeats = args.repeats or plan.repeats
    plan.budget_s = args.budget_s or plan.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    peak_flops, peak_note = peak_for(device, dtype, args.peak_tflops)
    split_reason = split_unsupported_reason()
    arms = [arm for arm in ARM_KWARGS if not (arm == "operator+split" and split_reason)]
    arm_notes = [f"operator+split left out: {split_reason}"] if split_reason else []
    if device_type == "cpu":
        for arm in ("operator/run_ahead", "operator/run_ahead2", "operator/on_preempt"):
            arms.remove(arm)
            arm_notes.append(f"{arm} left out: the same as operator on CPU (no streams)")
    if args.arms:
        arm_notes += [f"{arm} left out: not in --arms" for arm in arms if arm not in args.arms]
        arms = [arm for arm in arms if arm in args.arms]
    command = sys.argv[1:] if argv is None else list(argv)
    results: dict[str, Any] = {
        "command": ["python", "benchmarks/gpu_validate.py", *command],
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "device": device_info(device, dtype, peak_note),
        "plan": asdict(plan),
        "arms": arms,
        "arm_notes": arm_notes,
        "sections": {},
    }
    console.print(
        f"[bold]FlowPrefill validation[/bold] on {results['device']['name']} ({device}, "
        f"{results['device']['dtype']}), budget {plan.budget_s:.0f} s, arms {', '.join(arms)}"
    )
    for note in arm_notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    proc = None
    if device_type == "cuda" and "checks" in args.sections and not args.no_pytest:
        proc = start_device_tests(args.out)  # before the build: its CPU work overlaps it
    started = time.perf_counter()
    try:
        model = build_model(model_name, args.layers, device, dtype, args.seed)
    except torch.cuda.OutOfMemoryError:
        console.print("[red]out of memory building the model: try --layers 16[/red]")
        return 2
    config = model.config
    results["model"] = {
        "name": model_name + (f"-{args.layers}l" if args.layers else ""),
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "intermediate": config.intermediate_size,
        "vocab": config.vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "build_s": round(time.perf_counter() - started, 2),
        "note": "random weights, initialised on the device from a LlamaConfig",
    }
    if args.layers and args.layers != SHAPES[model_name]["num_hidden_layers"]:
        results["model"]["note"] += (
            f"; {args.layers} of {SHAPES[model_name]['num_hidden_layers']} layers (prefill "
            "times scale about linearly with layers)"
        )
    console.print(
        f"model {results['model']['name']}: {results['model']['parameters'] / 1e9:.2f} B "
        f"parameters, built in {results['model']['build_s']:.1f} s"
    )
    budget = Budget(plan.budget_s, [n for n in SECTIONS if n in args.sections], clock_start_s)
    ctx = Context(
        args, console, device, dtype, model, plan, budget, args.out, results, arms, peak_flops
    )
    ctx.pytest_proc = proc
    for name in SECTIONS:
        if name in args.sections:
            run_section(ctx, name)
    if proc is not None and proc.poll() is None:
        proc.kill()
    results["elapsed_s"] = round(budget.elapsed_s(), 1)
    write_results(ctx)
    statuses = {name: rec["status"] for name, rec in results["sections"].items()}
    summary = ", ".join(f"{name} {status}" for name, status in statuses.items())
    console.print(f"done in {results['elapsed_s']:.0f} s: {summary}; results in {args.out}")
    return 1 if any(s in ("failed", "error") for s in statuses.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
