"""Measuring what operator splitting predicts from, once per executor on its device.

:func:`calibrate` measures the two rates :class:`~flowprefill.prefill.executor.splitting.SplitRates`
holds (GEMM and attention FLOP/s) and, on CUDA, a
:class:`~flowprefill.prefill.executor.tiling.RowProfile` per decoder weight shape (a GPU GEMM's
time per row has a wave-quantisation sawtooth that one rate cannot see; the tile planner
uses the profile). Split from :mod:`~flowprefill.prefill.executor.splitting`, which owns what is
done with them during a forward.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

from flowprefill.prefill.executor.context import thread_context
from flowprefill.prefill.executor.splitting import SplitHandle, SplitRates, _pairs, block_attention
from flowprefill.prefill.executor.tiling import (
    GPU_PIECE_OVERHEAD_S,
    GRID_HEADROOM,
    MAX_PROFILED_ROWS,
    RowProfile,
    grid,
)


def _best_time(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls after a warm-up: on a shared machine the
    minimum is the steadiest estimate of what the device can do (slower runs measure the
    neighbours)."""
    fn()
    sync()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def calibrate(
    handle: SplitHandle,
    num_heads: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype,
    sync: Callable[[], None],
    rows: int = 512,
    keys: int = 2048,
    repeats: int = 5,
    *,
    max_blocking_s: float | None = None,
    profile_rows: bool | None = None,
) -> SplitRates:
    """Measure the two rates on this device: the widest decoder linear at ``rows`` rows
    (through its installed forward, fast kernels on), and a block of ``rows`` queries
    over ``keys`` keys in the model's head shape (0.1-0.3 s for demo-llama on CPU).

    ``profile_rows`` (default: on CUDA, where a GEMM's time per row is not constant):
    also time every distinct decoder weight shape at the grid of row counts
    (:func:`~flowprefill.prefill.executor.tiling.grid`) up to :data:`GRID_HEADROOM` times the rows
    that fit ``max_blocking_s`` at the measured rate (fastest of ``repeats`` each; ~1 s
    for Llama-3-8B on an H100 by the FLOP count — not measured on a GPU yet)."""
    if profile_rows is None:
        profile_rows = device.type == "cuda"
    profiles: dict[float, RowProfile] = {}
    with torch.inference_mode(), thread_context.forward(fast_kernels=True):
        if handle.linears:
            module, cost = max(handle.linears, key=lambda item: item[1])
            assert isinstance(module, nn.Linear)
            x = torch.randn(rows, module.weight.shape[1], device=device, dtype=dtype)
            gemm_s = _best_time(lambda: module(x), sync, repeats)
            gemm_rate = cost * rows / max(gemm_s, 1e-9)
            if profile_rows and max_blocking_s is not None:
                profiles = _profile_shapes(handle, gemm_rate, max_blocking_s, device, dtype,
                                           sync, repeats)  # fmt: skip
        else:
            gemm_rate = math.inf
        q = torch.randn(1, num_heads, rows, head_dim, device=device, dtype=dtype)
        k = torch.randn(1, num_heads, keys, head_dim, device=device, dtype=dtype)
        attn_s = _best_time(
            lambda: block_attention(q, k, k, 0, rows, keys - rows, None), sync, repeats
        )
        attn_rate = 4.0 * num_heads * head_dim * _pairs(keys - rows, 0, rows) / max(attn_s, 1e-9)
    return SplitRates(
        gemm_flop_per_s=gemm_rate,
        attention_flop_per_s=attn_rate,
        gemm_profiles=profiles,
        piece_overhead_s=GPU_PIECE_OVERHEAD_S if profiles else 0.0,
    )


def _profile_shapes(
    handle: SplitHandle,
    gemm_rate: float,
    max_blocking_s: float,
    device: torch.device,
    dtype: torch.dtype,
    sync: Callable[[], None],
    repeats: int,
) -> dict[float, RowProfile]:
    """One :class:`RowProfile` per distinct weight shape among the split linears (the
    first module of each shape stands for all: same shape, same kernels)."""
    profiles: dict[float, RowProfile] = {}
    for module, cost in handle.linears:
        if cost in profiles or not isinstance(module, nn.Linear):
            continue
        fit = int(GRID_HEADROOM * max_blocking_s * gemm_rate / max(cost, 1.0))
        sizes = grid(min(MAX_PROFILED_ROWS, fit))
        if len(sizes) < 2:
            continue  # the bound is under one grid step of rows: nothing to choose
        x = torch.randn(sizes[-1], module.weight.shape[1], device=device, dtype=dtype)
        # ``forward``, not ``__call__``: a tile runs the forward without the module's
        # hooks (a TP all-reduce runs once, after the whole linear), so it is timed so.
        forward = module.forward
        times = [_best_time(_call(forward, x[:m]), sync, repeats) for m in sizes]
        profiles[cost] = RowProfile(tuple(sizes), tuple(max(t, 1e-9) for t in times))
    return profiles


def _call(fn: Callable[[torch.Tensor], object], x: torch.Tensor) -> Callable[[], object]:
    return lambda: fn(x)
