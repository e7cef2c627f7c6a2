"""``flowprefill profile``: fit the TTFT predictor on this engine and hardware."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo-llama", help="local model dir or built-in name")
    p.add_argument("--out", default="ttft-profile.json", help="where to write the profile")
    p.add_argument("--min-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--points", type=int, default=8, help="profiled token counts")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per token count")
    p.add_argument("--degree", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--granularity", default="operator", choices=["operator", "layer", "none"])
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: profile the TP engine the instance will run (ranks are "
        "spawned here; on CPU the cores are split between them)",
    )


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from flowprefill.contracts import EngineConfig
    from flowprefill.prefill.factory import build_backend, profile_executor

    console = Console()
    try:
        config = EngineConfig(
            model_path=args.model,
            device=args.device,
            dtype=args.dtype,
            granularity=args.granularity,
            tp_size=args.tp,
        )
    except ValidationError as e:
        console.print(f"[red]bad profile settings: {e}[/red]")
        return 2
    with console.status(f"loading {args.model} (tp_size {args.tp})"):
        backend = build_backend(config)
    try:
        report = profile_executor(
            backend,
            min_tokens=args.min_tokens,
            max_tokens=args.max_tokens,
            num_points=args.points,
            repeats=args.repeats,
            degree=args.degree,
            model_name=args.model,
        )
    finally:
        backend.close()
    p = report.predictor
    table = Table(title=f"TTFT profile of {args.model} on {p.hardware}")
    table.add_column("tokens", justify="right")
    table.add_column("measured ms", justify="right")
    table.add_column("predicted ms", justify="right")
    table.add_column("error", justify="right")
    rows = [(n, t, "fit") for n, t in p.samples] + [(n, t, "held out") for n, t in report.holdout]
    for n, t, kind in sorted(rows):
        pred = p.predict_s(n)
        table.add_row(
            f"{n}{'*' if kind == 'held out' else ''}",
            f"{t * 1e3:.1f}",
            f"{pred * 1e3:.1f}",
            f"{(pred - t) / t:+.1%}",
        )
    console.print(table)
    console.print("* held-out lengths (not used by the fit)")
    if p.fit_error is not None:
        console.print(
            f"fit error: {p.fit_error.mean_abs_pct:.1f}% mean, {p.fit_error.max_abs_pct:.1f}% max"
        )
    if report.holdout_error is not None:
        console.print(
            f"held-out error: {report.holdout_error.mean_abs_pct:.1f}% mean, "
            f"{report.holdout_error.max_abs_pct:.1f}% max"
        )
    p.save(args.out)
    console.print(f"wrote {args.out} (format_version {p.format_version}, degree {p.degree})")
    return 0
