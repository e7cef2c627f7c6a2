"""Measured per-operator A100 times of Llama-3-8B (microsoft/vidur profile, MIT licence).

The CSV (``flowprefill/data/vidur/``) has one row per ``(num_tokens, TP degree)`` with
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
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np
import numpy.typing as npt

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

    def time_ms(self, op: str, num_tokens: float) -> float:
        """Linear interpolation; beyond the largest profiled count, scaled linearly in n
        (every operator is throughput-bound there)."""
        xs = self.num_tokens
        ys = self.times_ms[op]
        if num_tokens > xs[-1]:
            return float(ys[-1] * num_tokens / xs[-1])
        return float(np.interp(num_tokens, xs, ys))


def _csv_text() -> str:
    return resources.files("flowprefill").joinpath("data", "vidur", CSV_NAME).read_text()


@cache
def load_tables() -> dict[int, OperatorTable]:
    """Parse the packaged CSV once per process: ``{tp: OperatorTable}``."""
    rows = csv.DictReader(_csv_text().splitlines())
    acc: dict[tuple[int, int], dict[str, list[float]]] = {}
    for row in rows:
        key = (int(row["num_tensor_parallel_workers"]), int(row["num_tokens"]))
        slot = acc.setdefault(key, {op: [] for op in VIDUR_OPS})
        for op in VIDUR_OPS:
            slot[op].append(float(row[f"time_stats.{op}.median"]))
    tables: dict[int, OperatorTable] = {}
    for tp in sorted({tp for tp, _ in acc}):
        ns = sorted(n for t, n in acc if t == tp)
        times = {
            op: np.array([np.mean(acc[(tp, n)][op]) for n in ns], dtype=np.float64)
            for op in VIDUR_OPS
        }
        tables[tp] = OperatorTable(tp, np.array(ns, dtype=np.float64), times)
    return tables
