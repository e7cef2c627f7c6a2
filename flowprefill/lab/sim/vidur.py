"""Measured per-operator A100 times of Llama-3-8B (microsoft/vidur profile, MIT licence).

The CSV (``flowprefill/lab/sim/data/vidur/``) has one row per ``(num_tokens, TP degree)`` with
statistics per operator in milliseconds. We take the **median** of each operator (rows
repeated for the same key are averaged) and group vidur's operators into the five
segments between FlowPrefill's checkpoints (paper §5.1):

==============  ==========================================================
segment         vidur operators (what runs between two checkpoints)
==============  ==========================================================
``qkv_proj``    input_layernorm + attn_pre_proj + attn_rope
``attention``   — (not profiled; modelled from FLOPs in :mod:`.cost`)
``o_proj``      attn_post_proj + add (first residual)
``gate_up``     post_attention_layernorm + mlp_up_proj
``down_proj``   mlp_act + mlp_down_proj + add (second residual)
==============  ==========================================================

``emb`` runs once per forward pass, before the first layer.

A **calibration** (``flowprefill simulate --gpu G --calibration PATH``) is a CSV of the
same format measured on another GPU (benchmarks/gpu_validate.py writes one with
:func:`write_calibration`), optionally with one more operator, ``attention`` (see
:data:`ATTENTION_OP`). Its operators replace the A100 profile scaled by peak FLOP/s.
Columns read (any others, such as vidur's ``n_head`` or the min/max/mean/std statistics,
may be present and are ignored unless noted):

* ``num_tokens`` — tokens in the pass (a positive integer);
* ``num_tensor_parallel_workers`` — TP degree the row was measured at (a positive integer);
* ``time_stats.<op>.median`` for every ``<op>`` of :data:`VIDUR_OPS`, in milliseconds;
* optional ``time_stats.attention.median`` — one layer's causal prefill attention over
  ``num_tokens`` tokens with no cache, per GPU (heads / TP), in milliseconds; in every
  row or none. Without it, attention stays FLOP-modelled.
* optional ``n_embd``, ``n_head``, ``n_kv_head``, ``n_expanded_embd`` — the measured
  model's shape; when present it must be the reference model's (Llama-3-8B), which every
  other model is scaled from.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from flowprefill.errors import InvalidRequestError

CSV_NAME = "a100_Meta-Llama-3-8B_mlp.csv"

VIDUR_OPS = (
    "emb",
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)

ATTENTION_OP = "attention"
"""The optional extra operator of a calibration: one layer's causal prefill attention of
``num_tokens`` tokens with no cache, on one GPU (its heads / TP), milliseconds."""

SHAPE_COLUMNS = {
    "n_head": "num_heads",
    "n_kv_head": "num_kv_heads",
    "n_embd": "hidden_size",
    "n_expanded_embd": "intermediate_size",
}
"""vidur's shape columns → :class:`~flowprefill.lab.sim.hardware.ModelShape` fields."""

SEGMENT_OPS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("input_layernorm", "attn_pre_proj", "attn_rope"),
    "o_proj": ("attn_post_proj", "add"),
    "gate_up": ("post_attention_layernorm", "mlp_up_proj"),
    "down_proj": ("mlp_act", "mlp_down_proj", "add"),
}

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class OperatorTable:
    """Median operator times (ms) of one TP degree, by ascending token count."""

    tp: int
    num_tokens: FloatArray
    times_ms: dict[str, FloatArray]
    attention_ms: FloatArray | None = None
    """Measured ``attention`` (a calibration's optional column); None: not measured."""
    shape: dict[str, int] = field(default_factory=dict)
    """The measured model's shape from the shape columns, by ModelShape field name."""

    def time_ms(self, op: str, num_tokens: float) -> float:
        """Linear interpolation; beyond the largest profiled count, scaled linearly in n
        (every operator is throughput-bound there)."""
        xs = self.num_tokens
        ys = self.times_ms[op]
        if num_tokens > xs[-1]:
            return float(ys[-1] * num_tokens / xs[-1])
        return float(np.interp(num_tokens, xs, ys))

    def attention_time_ms(self, num_tokens: float) -> float:
        """Measured prefill attention at ``num_tokens`` (no cache): linear interpolation,
        the smallest measurement below the table (a kernel's floor), and quadratic
        scaling beyond it (causal pairs grow with the square)."""
        if self.attention_ms is None:
            raise ValueError("this table has no measured attention")
        xs, ys = self.num_tokens, self.attention_ms
        if num_tokens > xs[-1]:
            return float(ys[-1] * (num_tokens / xs[-1]) ** 2)
        return float(np.interp(num_tokens, xs, ys))


def _csv_text() -> str:
    return resources.files("flowprefill.lab.sim").joinpath("data", "vidur", CSV_NAME).read_text()


@cache
def load_tables(path: str | Path | None = None) -> dict[int, OperatorTable]:
    """``{tp: OperatorTable}`` of the packaged A100 profile, or of the calibration CSV at
    ``path`` (errors name the file and line); parsed once per process and path."""
    if path is None:
        return parse_tables(_csv_text(), source=CSV_NAME)
    return read_tables(path)


def read_tables(path: str | Path) -> dict[int, OperatorTable]:
    """:func:`load_tables` of a file, read now (not cached)."""
    p = Path(path)
    if not p.is_file():
        raise InvalidRequestError(f"--calibration {p}: no such file")
    return parse_tables(p.read_text(), source=str(p))


def _number(row: Mapping[str, str | None], column: str, where: str) -> float:
    text = row.get(column)
    if text is None or text == "":
        raise InvalidRequestError(f"{where}: column {column!r} is empty")
    try:
        value = float(text)
    except ValueError:
        raise InvalidRequestError(f"{where}: {column} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise InvalidRequestError(f"{where}: {column} {text!r} is not finite")
    return value


def _count(row: Mapping[str, str | None], column: str, where: str) -> int:
    value = _number(row, column, where)
    if value != int(value) or value < 1:
        raise InvalidRequestError(f"{where}: {column} must be a positive integer, got {value:g}")
    return int(value)


def parse_tables(text: str, *, source: str) -> dict[int, OperatorTable]:
    """Parse vidur-format CSV text: the median of each operator per ``(TP, num_tokens)``
    (rows repeated for the same key are averaged)."""
    reader = csv.DictReader(text.splitlines())
    columns = set(reader.fieldnames or ())
    required = ["num_tokens", "num_tensor_parallel_workers"]
    required += [f"time_stats.{op}.median" for op in VIDUR_OPS]
    missing = [c for c in required if c not in columns]
    if missing:
        raise InvalidRequestError(
            f"{source}: missing column(s) {', '.join(missing)} (docs/simulator.md, "
            '"Calibration from measured GPU times")'
        )
    attention_column = f"time_stats.{ATTENTION_OP}.median"
    has_attention = attention_column in columns
    ops = (*VIDUR_OPS, ATTENTION_OP) if has_attention else VIDUR_OPS
    acc: dict[tuple[int, int], dict[str, list[float]]] = {}
    shape: dict[str, int] = {}
    for line_no, row in enumerate(reader, start=2):
        where = f"{source} line {line_no}"
        key = (_count(row, "num_tensor_parallel_workers", where), _count(row, "num_tokens", where))
        slot = acc.setdefault(key, {op: [] for op in ops})
        for op in ops:
            value = _number(row, f"time_stats.{op}.median", where)
            if value < 0:
                raise InvalidRequestError(f"{where}: time_stats.{op}.median is negative")
            slot[op].append(value)
        for column, name in SHAPE_COLUMNS.items():
            if row.get(column) not in (None, ""):
                value = _count(row, column, where)
                if shape.setdefault(name, value) != value:
                    raise InvalidRequestError(
                        f"{where}: {column} {value} differs from earlier rows ({shape[name]})"
                    )
    if not acc:
        raise InvalidRequestError(f"{source}: no rows")
    tables: dict[int, OperatorTable] = {}
    for tp in sorted({tp for tp, _ in acc}):
        ns = sorted(n for t, n in acc if t == tp)
        times = {
            op: np.array([np.mean(acc[(tp, n)][op]) for n in ns], dtype=np.float64) for op in ops
        }
        attention = times.pop(ATTENTION_OP, None)
        tables[tp] = OperatorTable(tp, np.array(ns, dtype=np.float64), times, attention, shape)
    return tables


# ----------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class CalibrationRow:
    """Measured operator times of one pass size: what :func:`write_calibration` writes.

    ``times_ms`` maps every operator of :data:`VIDUR_OPS` (and optionally
    :data:`ATTENTION_OP`) to its repeated measurements in milliseconds; the file gets
    their min / max / mean / median / std, as vidur's does. The shape fields are written
    to vidur's shape columns when given."""

    num_tokens: int
    times_ms: Mapping[str, Sequence[float]]
    num_tensor_parallel_workers: int = 1
    num_heads: int | None = None
    num_kv_heads: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None

    def to_csv_row(self) -> dict[str, Any]:
        if self.num_tokens < 1 or self.num_tensor_parallel_workers < 1:
            raise InvalidRequestError(
                f"calibration row: num_tokens ({self.num_tokens}) and "
                f"num_tensor_parallel_workers ({self.num_tensor_parallel_workers}) must be ≥ 1"
            )
        unknown = sorted(set(self.times_ms) - {*VIDUR_OPS, ATTENTION_OP})
        if unknown:
            raise InvalidRequestError(f"calibration row: unknown operator(s) {unknown}")
        row: dict[str, Any] = {}
        for op in (*VIDUR_OPS, ATTENTION_OP):
            values = [float(v) for v in self.times_ms.get(op, ())]
            if not values:
                if op == ATTENTION_OP:
                    continue
                raise InvalidRequestError(
                    f"calibration row at {self.num_tokens} tokens: no times for {op!r}"
                )
            if any(not math.isfinite(v) or v < 0 for v in values):
                raise InvalidRequestError(f"calibration row: {op} times must be finite, ≥ 0")
            row[f"time_stats.{op}.min"] = min(values)
            row[f"time_stats.{op}.max"] = max(values)
            row[f"time_stats.{op}.mean"] = statistics.fmean(values)
            row[f"time_stats.{op}.median"] = statistics.median(values)
            row[f"time_stats.{op}.std"] = statistics.pstdev(values)
        for column, name in SHAPE_COLUMNS.items():
            value = getattr(self, name)
            if value is not None:
                row[column] = value
        row["num_tokens"] = self.num_tokens
        row["num_tensor_parallel_workers"] = self.num_tensor_parallel_workers
        return row


def write_calibration(path: str | Path, rows: Iterable[CalibrationRow | Mapping[str, Any]]) -> Path:
    """Write a calibration CSV that ``--calibration`` reads, and check it parses.

    ``rows`` are :class:`CalibrationRow` records, or rows already in the file's format
    (``{column: value}`` with the columns of the module docstring, e.g. vidur's own).
    Either every row has the ``attention`` operator or none does."""
    out: list[dict[str, Any]] = [
        r.to_csv_row() if isinstance(r, CalibrationRow) else dict(r) for r in rows
    ]
    if not out:
        raise InvalidRequestError("write_calibration: no rows")
    fields = list(dict.fromkeys(k for r in out for k in r))
    attention = f"time_stats.{ATTENTION_OP}.median"
    with_attention = sum(attention in r for r in out)
    if 0 < with_attention < len(out):
        raise InvalidRequestError(
            f"write_calibration: {with_attention} of {len(out)} rows have {ATTENTION_OP!r} "
            "times; give them for every row or none"
        )
    p = Path(path)
    with p.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(out)
    read_tables(p)  # the simulator must be able to read what was written
    return p
