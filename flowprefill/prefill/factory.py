"""Wiring an :class:`~flowprefill.contracts.EngineConfig` into a model executor and predictor.

Kept apart from the engine so the scheduler and pool never import torch or transformers.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from rich.console import Console
from transformers import PreTrainedModel

from flowprefill.contracts import EngineConfig
from flowprefill.kv.format import DTYPES
from flowprefill.models import load_model
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.predictor.profile import ProfileReport, profile
from flowprefill.prefill.tp.prefill_backend import TPPrefillBackend

log = logging.getLogger(__name__)


def load_engine_model(config: EngineConfig) -> PreTrainedModel:
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    return load_model(config.model_path, dtype=DTYPES[config.dtype], device=config.device)


def build_executor(
    config: EngineConfig, model: PreTrainedModel | None = None
) -> PreemptibleExecutor:
    """An executor for ``config``; pass ``model`` to share weights between executors
    (close the previous executor first: each installs its own checkpoint hooks)."""
    model = model if model is not None else load_engine_model(config)
    return PreemptibleExecutor(
        model,
        granularity=config.granularity,
        chunk_size=config.chunk_size,
        device=config.device,
        kernels=config.resolved_kernels(),
        max_blocking_ms=config.resolved_max_blocking_ms(),
        sync=config.device_sync,
    )


def build_backend(config: EngineConfig) -> PreemptibleExecutor | TPPrefillBackend:
    """The :class:`~flowprefill.prefill.engine.PrefillBackend` ``config`` asks for: one
    executor, or ``tp_size`` ranks (this process is rank 0 and spawns the others; close the
    backend to stop them)."""
    if config.tp_size > 1:
        return TPPrefillBackend(config)
    return build_executor(config)


def model_config_of(backend: PreemptibleExecutor | TPPrefillBackend) -> Any:
    """The Hugging Face config of the model a backend runs (the KV fingerprint's source)."""
    if isinstance(backend, PreemptibleExecutor):
        return backend.model.config
    return backend.model_config


def profile_executor(
    executor: PreemptibleExecutor | TPPrefillBackend,
    *,
    min_tokens: int = 32,
    max_tokens: int = 4096,
    num_points: int = 8,
    repeats: int = 3,
    degree: int = 2,
    model_name: str = "",
    seed: int = 0,
) -> ProfileReport:
    """Time real prefills of random prompts on ``executor`` and fit the predictor."""
    gen = torch.Generator().manual_seed(seed)
    max_tokens = min(max_tokens, executor.max_prompt_tokens)

    def run(n: int) -> None:
        ids = torch.randint(0, executor.vocab_size, (n,), generator=gen)
        # run(), not prefill(): with tensor parallelism every rank must take part.
        executor.run([ids], TaskControl("profile"))

    hardware = str(executor.device)
    if executor.device.type == "cpu":
        hardware = f"cpu ({torch.get_num_threads()} threads)"
    if isinstance(executor, TPPrefillBackend):
        hardware += f" × TP{executor.config.tp_size}"
    return profile(
        run,
        min_tokens=min_tokens,
        max_tokens=max_tokens,
        num_points=num_points,
        repeats=repeats,
        degree=degree,
        hardware=hardware,
        model=model_name,
    )


def quick_profile(
    executor: PreemptibleExecutor | TPPrefillBackend, console: Console, model_name: str = ""
) -> TTFTPredictor:
    """A short sweep for demos (about ten seconds on the demo model)."""
    console.print("[dim]no TTFT profile given: profiling this machine briefly…[/dim]")
    report = profile_executor(
        executor, num_points=6, repeats=2, max_tokens=4096, model_name=model_name
    )
    err = report.holdout_error
    if err is not None:
        console.print(
            f"[dim]TTFT predictor: degree {report.predictor.degree}, held-out error "
            f"{err.mean_abs_pct:.1f}% mean, {err.max_abs_pct:.1f}% max[/dim]"
        )
    return report.predictor
