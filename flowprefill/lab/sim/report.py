"""The sweep's table (rich), its JSON, and the comparison with the paper's figures."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from flowprefill.lab.sim.sweep import SweepResult

CLASS_ORDER = ("text", "image", "search", "file")


@dataclass(frozen=True, slots=True)
class PaperFigure:
    label: str
    ours: float | None
    paper: str
    low: float
    high: float
    """The paper's range; "up to X" is (1, X]; a single value counts within ±20 %."""

    @property
    def verdict(self) -> str:
        if self.ours is None:
            return "—"
        if self.ours < self.low:
            return "below"
        if self.ours > self.high:
            return "above"
        return "in range"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0 or math.isinf(a) or math.isinf(b):
        return None
    return a / b


def paper_comparison(result: SweepResult) -> list[PaperFigure]:
    """Our figures beside the paper's (DESIGN.md, "Paper figures to reproduce")."""
    s = result.by_name()

    def goodput(name: str) -> float | None:
        return s[name].goodput_rps if name in s else None

    def scale(name: str) -> float | None:
        return s[name].tightest_slo_scale if name in s else None

    fp = s.get("flowprefill")
    layer = s.get("sedf-layer")
    fp_goodput, fp_scale = goodput("flowprefill"), scale("flowprefill")
    fp_mean = fp.reference.blocking_mean_ms if fp else None
    layer_mean = layer.reference.blocking_mean_ms if layer else None
    return [
        PaperFigure(
            "goodput FlowPrefill / DistServe FCFS",
            _ratio(fp_goodput, goodput("distserve-fcfs")),
            "4.7–5.6×",
            4.7,
            5.6,
        ),
        PaperFigure(
            "goodput FlowPrefill / DistServe-CP2K",
            _ratio(fp_goodput, goodput("distserve-cp2k")),
            "up to 2.0×",
            1.0,
            2.0,
        ),
        PaperFigure(
            "goodput FlowPrefill / DistServe-CP8K",
            _ratio(fp_goodput, goodput("distserve-cp8k")),
            "up to 4.5×",
            1.0,
            4.5,
        ),
        PaperFigure(
            "tighter SLO vs CP2K (scale CP2K / FlowPrefill)",
            _ratio(scale("distserve-cp2k"), fp_scale),
            "1.5–2.3×",
            1.5,
            2.3,
        ),
        PaperFigure(
            "tighter SLO vs CP8K (scale CP8K / FlowPrefill)",
            _ratio(scale("distserve-cp8k"), fp_scale),
            "2.1–3.1×",
            2.1,
            3.1,
        ),
        PaperFigure("operator-level blocking, mean (ms)", fp_mean, "2.6 ms", 2.08, 3.12),
        PaperFigure(
            "operator-level blocking, max (ms)",
            fp.reference.blocking_max_ms if fp else None,
            "< 4.5 ms",
            0.0,
            4.5,
        ),
        PaperFigure(
            "blocking layer / operator (mean)", _ratio(layer_mean, fp_mean), "3.5–4.2×", 3.5, 4.2
        ),
    ]


def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "—"
    if math.isinf(x):
        return "∞"
    return f"{x:.{digits}f}"


def _classes(result: SweepResult) -> list[str]:
    seen = {c for o in result.systems for c in o.reference.per_class}
    return [c for c in CLASS_ORDER if c in seen] + sorted(seen - set(CLASS_ORDER))


def systems_table(result: SweepResult) -> Table:
    ref = result.reference_rate_rps
    table = Table(
        title=(
            f"{result.cost_model} · {result.num_requests} requests · work-conserving bound "
            f"{result.bound_rps:.2f} req/s · blocking and rounds at {ref:.2f} req/s"
        )
    )
    fcfs = result.by_name().get("distserve-fcfs")
    for name, justify in (
        ("system", "left"),
        ("goodput\nreq/s", "right"),
        ("oracle\nreq/s", "right"),
        ("% of\nbound", "right"),
        ("× FCFS", "right"),
        ("tightest\nSLO scale", "right"),
        ("blocking ms\nmean / max", "right"),
        ("rounds\n/ req", "right"),
        ("saturated\nktok/s", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for o in result.systems:
        r = o.reference
        table.add_row(
            o.label,
            _fmt(o.goodput_rps),
            _fmt(o.oracle_goodput_rps),
            _fmt(100 * o.goodput_rps / result.bound_rps, 0),
            _fmt(_ratio(o.goodput_rps, fcfs.goodput_rps if fcfs else None), 1),
            _fmt(o.tightest_slo_scale),
            f"{r.blocking_mean_ms:.1f} / {r.blocking_max_ms:.1f}",
            _fmt(r.rounds_per_request),
            f"{o.saturation_tokens_per_s / 1e3:.1f}",
        )
    return table


def classes_table(result: SweepResult) -> Table:
    """TTFT attainment per class, and the share of requests with a TBT SLO whose gap to
    the second token (KV hand-off over ``transport`` + one decode step) met it."""
    classes = _classes(result)
    transport = result.config.get("transport", "—")
    if result.config.get("kv_per_rank"):
        transport += ", per rank"
    table = Table(
        title=f"SLO attainment per class at {result.reference_rate_rps:.2f} req/s, SLO scale 1"
        f" · first gap = KV hand-off over {transport} + one decode step"
    )
    table.add_column("system")
    for c in ["all", *classes]:
        table.add_column(f"{c} %", justify="right")
    table.add_column("TBT 1st gap %", justify="right")
    for o in result.systems:
        r = o.reference
        cells = [o.label, _fmt(100 * r.attainment, 1)]
        for c in classes:
            met, total = r.per_class.get(c, (0, 0))
            cells.append(_fmt(100 * met / total, 1) if total else "—")
        gap = r.first_gap_attainment
        cells.append(_fmt(None if gap is None else 100 * gap, 1))
        table.add_row(*cells)
    return table


def paper_table(result: SweepResult) -> Table:
    table = Table(title=f"Against the paper's figures (ours: {result.cost_model})")
    table.add_column("figure")
    table.add_column("ours", justify="right")
    table.add_column("paper", justify="right")
    table.add_column("")
    for f in paper_comparison(result):
        table.add_row(f.label, _fmt(f.ours), f.paper, f.verdict)
    return table


def print_report(result: SweepResult, console: Console | None = None) -> None:
    console = console or Console()
    console.print(systems_table(result))
    console.print(classes_table(result))
    console.print(paper_table(result))
    console.print(f"sweep wall time {result.wall_s:.1f} s")


def _finite(obj: object) -> object:
    """JSON has no infinity: an unreachable SLO scale is written as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def write_json(result: SweepResult, path: Path) -> None:
    payload = result.to_json()
    payload["paper_comparison"] = [
        {"figure": f.label, "ours": f.ours, "paper": f.paper, "verdict": f.verdict}
        for f in paper_comparison(result)
    ]
    path.write_text(json.dumps(_finite(payload), indent=2) + "\n")
