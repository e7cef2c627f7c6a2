"""Section 4: per-operator times of one decoder layer over a token sweep, written as the
simulator's calibration table (vidur's mlp.csv columns; flowprefill/lab/sim/vidur.py) and
checked by parsing it with the simulator's own ``load_tables``."""

from __future__ import annotations

import csv
import inspect
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from benchmarks.gpuval.common import (
    SHAPES,
    Context,
    extrapolate_s,
    free_memory,
    memory_note,
    new_table,
)
from flowprefill.lab.sim import vidur

OPS = (*vidur.VIDUR_OPS, "attention")
SHORT = {
    "input_layernorm": "norm1",
    "attn_pre_proj": "qkv",
    "attn_rope": "rope",
    "attention": "attn",
    "attn_post_proj": "o",
    "post_attention_layernorm": "norm2",
    "mlp_up_proj": "gate_up",
    "mlp_act": "act",
    "mlp_down_proj": "down",
}


def time_calls(ctx: Context, fn: Callable[[], object], repeats: int) -> list[float]:
    """Milliseconds per call after two untimed ones: a pair of CUDA events around each
    call on the current stream, read after one synchronize (GPU); perf_counter (CPU)."""
    fn()
    fn()
    if not ctx.cuda:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    torch.cuda.synchronize(ctx.device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(repeats)
    ]
    for start_event, end_event in events:
        start_event.record()
        fn()
        end_event.record()
    torch.cuda.synchronize(ctx.device)  # elapsed_time needs both events completed
    return [start_event.elapsed_time(end_event) for start_event, end_event in events]


def layer_operators(ctx: Context, n: int) -> dict[str, Callable[[], object]]:
    """Decoder layer 0's operators at ``n`` tokens under vidur's names, as the model runs
    them (q/k/v and gate/up are separate linears in Hugging Face Llama: timed together),
    plus ``attention``: the causal sdpa call the executor makes for one request."""
    model: Any = ctx.model
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    gen = torch.Generator(device=ctx.device).manual_seed(n)
    hidden = ctx.config.hidden_size
    x = torch.randn(1, n, hidden, generator=gen, device=ctx.device, dtype=ctx.dtype)
    ids = torch.randint(0, int(ctx.config.vocab_size), (1, n), generator=gen, device=ctx.device)
    cos, sin = model.model.rotary_emb(x, torch.arange(n, device=ctx.device)[None])

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(1, n, -1, attn.head_dim).transpose(1, 2)

    q, k, v = heads(attn.q_proj(x)), heads(attn.k_proj(x)), heads(attn.v_proj(x))

    def attention() -> torch.Tensor:
        out, _ = sdpa_attention_forward(attn, q, k, v, None, scaling=attn.scaling, is_causal=True)
        return out

    attended = attention().reshape(1, n, -1)
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    act = mlp.act_fn(gate) * up
    return {
        "emb": lambda: model.model.embed_tokens(ids),
        "input_layernorm": lambda: layer.input_layernorm(x),
        "attn_pre_proj": lambda: (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)),
        "attn_rope": lambda: apply_rotary_pos_emb(q, k, cos, sin),
        "attention": attention,
        "attn_post_proj": lambda: attn.o_proj(attended),
        "post_attention_layernorm": lambda: layer.post_attention_layernorm(x),
        "mlp_up_proj": lambda: (mlp.gate_proj(x), mlp.up_proj(x)),
        "mlp_act": lambda: mlp.act_fn(gate) * up,
        "mlp_down_proj": lambda: mlp.down_proj(act),
        "add": lambda: x + attended,
    }


def calibration_row(config: Any, n: int, times: dict[str, list[float]]) -> dict[str, Any]:
    """One row of vidur's mlp.csv: min/max/mean/median/std (ms) per operator in vidur's
    order, the extra ``attention`` operator after them, then the shape columns."""
    row: dict[str, Any] = {}
    for op in OPS:
        values = times[op]
        row[f"time_stats.{op}.min"] = min(values)
        row[f"time_stats.{op}.max"] = max(values)
        row[f"time_stats.{op}.mean"] = statistics.fmean(values)
        row[f"time_stats.{op}.median"] = statistics.median(values)
        row[f"time_stats.{op}.std"] = statistics.pstdev(values)
    row.update(
        n_head=config.num_attention_heads,
        n_kv_head=config.num_key_value_heads,
        n_embd=config.hidden_size,
        n_expanded_embd=config.intermediate_size,
        vocab_size=config.vocab_size,
        use_gated_mlp=True,
        num_tokens=n,
        num_tensor_parallel_workers=1,
    )
    return row


def write_calibration(path: Path, rows: list[dict[str, Any]]) -> str:
    """Write the table; returns who wrote it. ``flowprefill.lab.sim.vidur.write_calibration``
    is used when this build has it (and accepts ``(path, rows)``), else the same columns
    are written here."""
    writer = getattr(vidur, "write_calibration", None)
    if writer is not None:
        try:
            writer(path, rows)
            parse_with_simulator(path)
            return "flowprefill.lab.sim.vidur.write_calibration"
        except Exception as err:  # a different signature: fall back to our own columns
            fallback = f"written here (write_calibration(path, rows) failed: {err})"
    else:
        fallback = "written here (flowprefill.lab.sim.vidur has no write_calibration)"
    with path.open("w", newline="") as handle:
        out = csv.DictWriter(handle, fieldnames=list(rows[0]))
        out.writeheader()
        out.writerows(rows)
    return fallback


def parse_with_simulator(path: Path) -> dict[int, Any]:
    """The simulator's parser over ``path``: ``load_tables(path)`` where it takes a path
    (``flowprefill simulate --calibration``), else (older builds) its reader of the
    packaged CSV pointed at ``path``, bypassing its cache."""
    if inspect.signature(vidur.load_tables).parameters:
        tables: dict[int, Any] = vidur.load_tables(path)
        return tables
    reader = getattr(vidur.load_tables, "__wrapped__", vidur.load_tables)
    with mock.patch.object(vidur, "_csv_text", path.read_text):
        tables = reader()
    return tables


def section_operators(ctx: Context, rec: dict[str, Any], deadline: float) -> None:
    notes: list[str] = rec.setdefault("notes", [])
    rows: list[dict[str, Any]] = []
    spent: list[tuple[int, float]] = []
    for n in ctx.plan.op_sweep:
        if n > ctx.config.max_position_embeddings:
            continue
        reason = memory_note(ctx, n)
        if reason is None and extrapolate_s(spent, n) > deadline - time.perf_counter():
            reason = "budget"
        if reason is not None:
            notes.append(f"sweep stopped before {n} tokens ({reason})")
            break
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                ops = layer_operators(ctx, n)
                times = {op: time_calls(ctx, fn, ctx.plan.op_repeats) for op, fn in ops.items()}
                del ops
        except torch.cuda.OutOfMemoryError:
            notes.append(f"sweep stopped at {n} tokens: out of memory")
            break
        finally:
            free_memory(ctx)
        spent.append((n, time.perf_counter() - started))
        rows.append(calibration_row(ctx.config, n, times))
        ctx.dim(f"operators: {n} tokens")
    if not rows:
        rec.update(status="skipped", reason="no token count fitted")
        return
    name = f"{ctx.results['device']['slug']}_{ctx.results['model']['name']}_mlp.csv"
    rec["written_by"] = write_calibration(ctx.out / name, rows)
    tables = parse_with_simulator(ctx.out / name)
    rec.update(
        csv=name,
        timer="CUDA events" if ctx.cuda else "perf_counter",
        parsed_by_simulator=sorted(tables) == [1],
        parsed_token_counts=[int(x) for x in tables[1].num_tokens],
    )
    rec["median_ms"] = [
        {"tokens": r["num_tokens"], **{op: r[f"time_stats.{op}.median"] for op in OPS}}
        for r in rows
    ]
    title = f"Median ms per operator, one layer ({rec['timer']}) → {name}"
    table = new_table(title, ("tokens", *(SHORT.get(op, op) for op in OPS)))
    for r in rec["median_ms"]:
        table.add_row(str(r["tokens"]), *(f"{r[op]:.3f}" for op in OPS))
    ctx.console.print(table)
    ctx.console.print(f"[dim]{rec['written_by']}; parsed by flowprefill.lab.sim.vidur[/dim]")
    compare_with_a100(ctx, rec, rows)


def compare_with_a100(ctx: Context, rec: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The simulator's segments here beside the packaged A100 profile (Llama-3-8B shape)."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    if any(getattr(ctx.config, key) != SHAPES["llama3-8b"][key] for key in keys):
        return
    a100 = vidur.load_tables()[1]
    columns = ("tokens", "segment", "here", "A100", "A100 / here")
    table = new_table("Segments, ms per layer: here vs the vidur A100 profile", columns)
    out = []
    for row in rows:
        n = row["num_tokens"]
        if n < 128:
            continue
        for segment, ops in vidur.SEGMENT_OPS.items():
            here = sum(row[f"time_stats.{op}.median"] for op in ops)
            ref = sum(a100.time_ms(op, n) for op in ops)
            out.append({"tokens": n, "segment": segment, "here_ms": here, "a100_ms": ref})
            table.add_row(str(n), segment, f"{here:.3f}", f"{ref:.3f}", f"{ref / here:.2f}×")
    rec["vs_a100"] = out
    ctx.console.print(table)
