"""The SLO table ``flowprefill up`` serves: the paper's four classes scaled to how much
slower this machine prefills than an A100 runs Llama-3-8B, or the user's ``--slo-table``.

``up`` is one user's stack, so its own tables let every client claim every class by name
(``x-slo-class``) and tighten its TTFT target (:meth:`SLOTable.open_to_anyone`); a full
slo-table.json passed with ``--slo-table`` keeps the claim rules it states."""

from __future__ import annotations

import json
import math
from pathlib import Path

from flowprefill.contracts import SLOTable, SLOTableClass
from flowprefill.contracts.slo import PAPER_PRIORITIES, TASK_TYPES
from flowprefill.errors import FlowPrefillError

SCALE_AT_TOKENS = 1024
"""Prompt length at which this machine's prefill is compared with the A100's."""

A100_PREFILL_S = 0.06847
"""Ideal prefill time of one ``SCALE_AT_TOKENS``-token prompt of Llama-3-8B on one A100, the
machine the paper's SLOs were set for: the simulator's cost model (vidur's A100 operator
profile, ideal batching, no per-pass overhead: ``build_cost_model("llama3-8b",
"a100").ideal_cost_s(SCALE_AT_TOKENS)`` in :mod:`flowprefill.lab.sim.cost`). A constant here
so that ``up`` does not import the lab; tests/lab/sim/test_reference_prefill.py fails when
the two part."""


def slo_table(scale: float) -> SLOTable:
    """The paper's four classes (Table 2, Llama-3-8B) scaled to this machine, open to
    every client."""
    return SLOTable.paper(scale=scale).open_to_anyone()


def load_slo_table(path: str | Path) -> SLOTable:
    """``--slo-table``: a slo-table.json, or ``{class: seconds}`` as ``flowprefill bench``
    reads it (classes ordered most urgent first: the paper's priorities where the name is
    one of its task types, then by SLO; the first is the default class; open to every
    client)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise FlowPrefillError(f"--slo-table {path}: {e}") from None
    if isinstance(data, dict) and "classes" in data:
        return SLOTable.model_validate(data)
    if not (
        isinstance(data, dict)
        and data
        and all(isinstance(v, int | float) and 0 < v < math.inf for v in data.values())
    ):
        raise FlowPrefillError(f"--slo-table {path}: expected {{class: seconds > 0}}")
    order = sorted(data, key=lambda c: (-PAPER_PRIORITIES.get(c, -1), data[c], c))
    classes = [
        SLOTableClass(
            name=name,
            task_type=name if name in TASK_TYPES else "other",
            ttft_slo_ms=max(1, round(float(data[name]) * 1e3)),
            priority=PAPER_PRIORITIES.get(name, 0),
            attainment_target=0.9,
        )
        for name in order
    ]
    return SLOTable(default_class=order[0], classes=classes).open_to_anyone()


def machine_scale(predict_s_1k: float) -> float:
    """How much slower this engine prefills ``SCALE_AT_TOKENS`` tokens than Llama-3-8B on an
    A100 (:data:`A100_PREFILL_S`); never below 1 (no SLO tighter than the paper's)."""
    return max(1.0, predict_s_1k / A100_PREFILL_S)
