"""Check the simulator against the real engine: same requests, predicted vs measured TTFT.

The engine run is described by one JSON object per request (JSONL)::

    {"request_id": "r0", "arrival_s": 0.0, "num_tokens": 512, "ttft_slo_s": 0.5,
     "slo_class": "text", "ttft_s": 0.231}

``arrival_s`` is on any clock (only differences matter). The simulator replays exactly
these arrivals, lengths and SLOs with the engine's own profile as the cost model
(``--profile``) and the same scheduler configuration, and reports the TTFT error.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from flowprefill.errors import InvalidRequestError
from flowprefill.lab.sim.config import SweepConfig
from flowprefill.lab.sim.driver import Simulation
from flowprefill.lab.sim.systems import build_instance, cached_predict, get_system
from flowprefill.prefill.request import Request

_FIELDS = ("request_id", "arrival_s", "num_tokens", "ttft_slo_s", "ttft_s")


@dataclass(frozen=True, slots=True)
class MeasuredRecord:
    request_id: str
    arrival_s: float
    num_tokens: int
    ttft_slo_s: float
    slo_class: str
    ttft_s: float


def load_measured(path: Path) -> list[MeasuredRecord]:
    if not path.is_file():
        raise InvalidRequestError(f"--compare-measured {path}: no such file")
    out: list[MeasuredRecord] = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path.name} line {line_no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or any(k not in row for k in _FIELDS):
            raise InvalidRequestError(f"{where}: needs the fields {', '.join(_FIELDS)}")
        try:
            rec = MeasuredRecord(
                str(row["request_id"]),
                float(row["arrival_s"]),
                int(row["num_tokens"]),
                float(row["ttft_slo_s"]),
                str(row.get("slo_class", "default")),
                float(row["ttft_s"]),
            )
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"{where}: {e}") from None
        if rec.num_tokens <= 0 or not rec.ttft_s > 0 or not math.isfinite(rec.arrival_s):
            raise InvalidRequestError(f"{where}: num_tokens and ttft_s must be positive")
        out.append(rec)
    if not out:
        raise InvalidRequestError(f"--compare-measured {path}: no records")
    return out


@dataclass(frozen=True)
class ValidationReport:
    num_requests: int
    mean_abs_error_ms: float
    mean_abs_error_pct: float
    p90_abs_error_pct: float
    max_abs_error_ms: float
    attainment_measured: float
    attainment_simulated: float
    simulated_work_s: float
    """Device time the simulated engine spent (compare with the engine's CPU time)."""
    mean_ttft_ms: dict[str, tuple[float, float]]
    """class → (measured, simulated) mean TTFT, over the requests both finished."""
    pairs: list[tuple[str, float, float]]
    """(request_id, measured TTFT, simulated TTFT) in seconds."""

    def summary(self) -> str:
        per_class = ", ".join(
            f"{c} {m:.0f} vs {s:.0f}" for c, (m, s) in sorted(self.mean_ttft_ms.items())
        )
        return (
            f"{self.num_requests} requests: simulated vs measured TTFT error "
            f"mean {self.mean_abs_error_ms:.1f} ms ({self.mean_abs_error_pct:.1f} %), "
            f"P90 {self.p90_abs_error_pct:.1f} %, max {self.max_abs_error_ms:.1f} ms; "
            f"SLO attainment measured {100 * self.attainment_measured:.1f} % vs simulated "
            f"{100 * self.attainment_simulated:.1f} %; mean TTFT ms measured vs simulated: "
            f"{per_class}"
        )


def compare_with_measured(
    cfg: SweepConfig, records: list[MeasuredRecord], *, system: str
) -> ValidationReport:
    cost = cfg.cost.build()
    predictor = cfg.cost.predictor(cost, cfg.max_blocking_s)
    t0 = min(r.arrival_s for r in records)
    requests = [
        Request.create(
            r.request_id,
            arrival_s=r.arrival_s - t0,
            ttft_slo_s=r.ttft_slo_s,
            num_tokens=r.num_tokens,
            slo_class=r.slo_class,
        )
        for r in records
    ]
    instance = build_instance(
        get_system(system),
        cost,
        cached_predict(predictor),
        live_progress=cfg.live_progress,
        max_blocking_s=cfg.max_blocking_s,
    )
    result = Simulation([instance]).run(requests)
    by_id = {r.request_id: r for r in requests}
    pairs: list[tuple[str, float, float]] = []
    for rec in records:
        sim_ttft = by_id[rec.request_id].ttft_s
        if sim_ttft is not None:
            pairs.append((rec.request_id, rec.ttft_s, sim_ttft))
    abs_s = [abs(s - m) for _, m, s in pairs]
    pct = sorted(100 * abs(s - m) / m for _, m, s in pairs)
    met_measured = sum(r.ttft_s <= r.ttft_slo_s for r in records)
    cls = {r.request_id: r.slo_class for r in records}
    groups: dict[str, list[tuple[float, float]]] = {}
    for rid, m, s in pairs:
        groups.setdefault(cls[rid], []).append((m, s))
        groups.setdefault("all", []).append((m, s))
    mean_ttft_ms = {
        c: (1e3 * statistics.fmean(m for m, _ in v), 1e3 * statistics.fmean(s for _, s in v))
        for c, v in groups.items()
    }
    return ValidationReport(
        num_requests=len(records),
        mean_abs_error_ms=1e3 * statistics.fmean(abs_s),
        mean_abs_error_pct=statistics.fmean(pct),
        p90_abs_error_pct=pct[min(len(pct) - 1, int(0.9 * len(pct)))],
        max_abs_error_ms=1e3 * max(abs_s),
        attainment_measured=met_measured / len(records),
        attainment_simulated=result.attainment,
        simulated_work_s=instance.pool.work_s,
        mean_ttft_ms=mean_ttft_ms,
        pairs=pairs,
    )
