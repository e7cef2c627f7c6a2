"""The gap between the first token (prefill) and the second (decode), per KV transport.

    python benchmarks/sim/handoff_gap.py [--gpu h100] [--json PATH]

For Llama-3-8B (TP1) and Llama-3-70B (TP4, the KV gathered to rank 0 as today, and sent by
every rank at once as NIXL allows): each prompt length the model allows (1K … 32K) × each
transport of :mod:`flowprefill.lab.sim.handoff` → the prompt's KV, the hand-off, the first
gap (hand-off + one decode step) and whether that gap meets the paper's TBT SLOs (§6.5:
0.1 s for text and image, 0.2 s for search and file). A pure model: no simulation runs;
well under a second. docs/simulator.md ("KV hand-off and the second token") shows the
output and every figure's source.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from flowprefill.lab.sim.handoff import (
    DECODE_HBM_EFFICIENCY,
    TBT_SLOS_S,
    TRANSPORTS,
    SecondTokenModel,
    build_second_token,
)
from flowprefill.lab.sim.hardware import GPUS, get_model

PROMPT_TOKENS = (1024, 4096, 8192, 16384, 32768)
SETUPS = (("llama3-8b", 1, True), ("llama3-70b", 4, True), ("llama3-70b", 4, False))
"""(model, TP, KV gathered to rank 0)."""
THRESHOLDS_S = tuple(sorted(set(TBT_SLOS_S.values())))
"""The paper's TBT SLOs: 0.1 s (text, image) and 0.2 s (search, file)."""


@dataclass(frozen=True, slots=True)
class GapRow:
    model: str
    tp: int
    mode: str
    """gathered (to rank 0, one stream) | per-rank (every rank sends its own heads)"""
    tokens: int
    transport: str
    kv_bytes: int
    handoff_ms: float
    decode_step_ms: float
    first_gap_ms: float
    meets: dict[str, bool]
    """TBT SLO in seconds, as text → first gap within it."""


def rows_for(gpu: str) -> list[GapRow]:
    """Every (setup, prompt length, transport) the setup's transports can do."""
    rows: list[GapRow] = []
    for model_name, tp, gathered in SETUPS:
        model = get_model(model_name)
        for transport in TRANSPORTS.values():
            if not gathered and not transport.per_rank:
                continue  # today's file path sends from rank 0 only
            m = build_second_token(model_name, gpu, transport.name, tp=tp, gather_to_rank0=gathered)
            rows.extend(
                _row(m, n, gathered) for n in PROMPT_TOKENS if n <= model.max_context_tokens
            )
    order = {t: i for i, t in enumerate(TRANSPORTS)}
    setups = {(m, tp, "gathered" if g else "per-rank"): i for i, (m, tp, g) in enumerate(SETUPS)}
    rows.sort(key=lambda r: (setups[(r.model, r.tp, r.mode)], r.tokens, order[r.transport]))
    return rows


def _row(m: SecondTokenModel, tokens: int, gathered: bool) -> GapRow:
    gap_s = m.first_gap_s(tokens)
    return GapRow(
        model=m.model.name,
        tp=m.tp,
        mode="gathered" if gathered else "per-rank",
        tokens=tokens,
        transport=m.transport.name,
        kv_bytes=m.kv_bytes(tokens),
        handoff_ms=1e3 * m.handoff_s(tokens),
        decode_step_ms=1e3 * m.decode_step_s(tokens + 1),
        first_gap_ms=1e3 * gap_s,
        meets={f"{t:g}": gap_s <= t for t in THRESHOLDS_S},
    )


def _size(nbytes: int) -> str:
    gib = nbytes / (1 << 30)
    return f"{gib:.2f} GiB" if gib >= 1 else f"{nbytes / (1 << 20):.0f} MiB"


def tables(rows: list[GapRow], gpu: str) -> list[Table]:
    out: list[Table] = []
    groups: dict[tuple[str, int, str], list[GapRow]] = {}
    for r in rows:
        groups.setdefault((r.model, r.tp, r.mode), []).append(r)
    for (model, tp, mode), group in groups.items():
        kib = get_model(model).kv_bytes_per_token() // 1024
        how = "KV gathered to rank 0" if mode == "gathered" else "every rank sends its heads"
        title = f"{model} TP{tp} on {gpu} ({kib} KiB/token; {how if tp > 1 else 'one GPU'})"
        table = Table(title=title)
        for col in ("tokens", "KV", "transport", "hand-off ms", "1st gap ms"):
            table.add_column(col, justify="left" if col == "transport" else "right")
        for t in THRESHOLDS_S:
            table.add_column(f"≤{t:g} s", justify="center")
        for i, r in enumerate(group):
            last = i + 1 == len(group) or group[i + 1].tokens != r.tokens
            table.add_row(
                f"{r.tokens:,}",
                _size(r.kv_bytes),
                r.transport,
                f"{r.handoff_ms:,.1f}",
                f"{r.first_gap_ms:,.1f}",
                *("✓" if ok else "✗" for ok in r.meets.values()),
                end_section=last,
            )
        step = group[0].decode_step_ms
        table.caption = f"1st gap = hand-off + one decode step ({step:.1f} ms at 1K tokens)"
        if mode == "per-rank":
            table.caption += "\nno file+http row: it sends from rank 0 only"
        out.append(table)
    return out


def to_json(rows: list[GapRow], gpu: str) -> dict[str, Any]:
    return {
        "gpu": gpu,
        "tbt_slos_s": TBT_SLOS_S,
        "decode_hbm_efficiency": DECODE_HBM_EFFICIENCY,
        "transports": {
            t.name: {
                "bandwidth_bytes_per_s": t.bandwidth_bytes_per_s,
                "line_rate_bytes_per_s": t.line_rate_bytes_per_s,
                "latency_s": t.latency_s,
                "staging_bytes_per_s": t.staging_bytes_per_s,
                "per_rank": t.per_rank,
                "link_per_gpu": t.link_per_gpu,
                "source": t.source,
            }
            for t in TRANSPORTS.values()
        },
        "rows": [
            {
                "model": r.model,
                "tp": r.tp,
                "mode": r.mode,
                "tokens": r.tokens,
                "transport": r.transport,
                "kv_bytes": r.kv_bytes,
                "handoff_ms": r.handoff_ms,
                "decode_step_ms": r.decode_step_ms,
                "first_gap_ms": r.first_gap_ms,
                "meets_tbt": r.meets,
            }
            for r in rows
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gpu", default="h100", choices=tuple(GPUS), help="decode (and gather) GPU")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write rows")
    args = ap.parse_args(argv)
    rows = rows_for(args.gpu)
    console = Console() if Console().is_terminal else Console(width=100)
    for table in tables(rows, args.gpu):
        console.print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(rows, args.gpu), indent=2) + "\n")
        console.print(f"wrote {len(rows)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
