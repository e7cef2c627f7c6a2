"""Wiring an :class:`~flowprefill.contracts.EngineConfig` into a model executor and predictor.

Kept apart from the engine so the scheduler and pool never import torch or transformers.
"""

from __future__ import annotations

import logging

import torch
from rich.console import Console
from transformers import PreTrainedModel

from flowprefill.contracts import EngineConfig
from flowprefill.executor.runner import PreemptibleExecutor
from flowprefill.predictor.model import TTFTPredictor
from flowprefill.predictor.profile import ProfileReport, profile

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_engine_model(config: EngineConfig) -> PreTrainedModel:
    from flowprefill.models import load_model

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
    )


def profile_executor(
    executor: PreemptibleExecutor,
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
        executor.prefill([ids])

    hardware = str(executor.device)
    if executor.device.type == "cpu":
        hardware = f"cpu ({torch.get_num_threads()} threads)"
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
    executor: PreemptibleExecutor, console: Console, model_name: str = ""
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
