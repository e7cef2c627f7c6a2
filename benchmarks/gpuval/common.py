"""What every section shares: the plan, the time budget, the model, and task plumbing."""

from __future__ import annotations

import argparse
import gc
import inspect
import math
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor, PrefillOutput

START_S = time.perf_counter()
"""From the command line the budget counts from here, importing torch included."""
ROOT = Path(__file__).resolve().parents[2]

SHAPES: dict[str, dict[str, Any]] = {
    # Meta-Llama-3(.1)-8B. max_position_embeddings of 3.1 so that 32K prompts validate; no
    # rope scaling (timing does not depend on it).
    "llama3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
    },
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 4096,
        "max_position_embeddings": 8192,
    },
}

PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    # Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, matched against
    # torch.cuda.get_device_name() in this order: the more specific name first.
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM5, named e.g. "NVIDIA H100 80GB HBM3"
    ("H200", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
)

ARM_KWARGS: dict[str, dict[str, Any]] = {
    "none": {"granularity": "none"},
    "layer": {"granularity": "layer"},
    "operator": {"granularity": "operator"},
    "operator+split": {"granularity": "operator", "max_blocking_ms": None},  # from --max-...
    "operator/run_ahead": {"granularity": "operator", "sync": "run_ahead", "run_ahead": 1},
    "operator/run_ahead2": {"granularity": "operator", "sync": "run_ahead", "run_ahead": 2},
    "operator/on_preempt": {"granularity": "operator", "sync": "on_preempt"},
}
"""Executor arms: PreemptibleExecutor keyword arguments (all others at their defaults)."""


@dataclass
class Plan:
    """Sizes and counts of one run; :func:`plan_for` picks them, CLI flags override."""

    sizes: list[int]
    repeats: int
    check_tokens: int
    blocking_tokens: int
    blocking_samples: int
    op_sweep: list[int]
    op_repeats: int
    urgent_long: int
    urgent_short: int
    urgent_trials: int
    budget_s: float


def plan_for(device_type: str, quick: bool) -> Plan:
    if device_type == "cuda" and not quick:
        sweep = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096]
        sweep += [6144, 8192, 12288, 16384, 24576, 32768]
        return Plan([512, 2048, 8192, 32768], 3, 2048, 32768, 100, sweep, 10, 32768, 512, 3, 500)
    if device_type == "cuda":
        sweep = [1, 16, 128, 512, 2048, 8192]
        return Plan([512, 2048], 2, 1024, 8192, 40, sweep, 5, 8192, 256, 2, 240)
    if quick:
        return Plan([64, 256, 1024], 2, 128, 1024, 10, [1, 16, 64, 256, 1024], 3, 1024, 32, 2, 60)
    sweep = [1, 4, 16, 64, 128, 256, 512, 1024, 2048]
    return Plan([128, 512, 2048], 3, 256, 2048, 60, sweep, 5, 4096, 64, 3, 300)


SHARES = {"checks": 0.12, "prefill": 0.30, "blocking": 0.22, "operators": 0.12, "urgent": 0.24}


class Budget:
    """One deadline for the whole run, shared out among the sections still to run: a
    section gets its share of what is left, so time one leaves unused goes to the next."""

    def __init__(self, total_s: float, sections: Sequence[str], start_s: float) -> None:
        self.total_s = total_s
        self.start_s = start_s
        self.pending = {name: SHARES[name] for name in sections}

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start_s

    def begin(self, section: str) -> tuple[float, float]:
        """``(deadline on the perf_counter clock, seconds)`` for ``section``."""
        share = self.pending.pop(section)
        rest = share + sum(self.pending.values())
        seconds = max(0.0, self.total_s - self.elapsed_s()) * share / rest
        return time.perf_counter() + seconds, seconds


@dataclass
class Context:
    """The run's state, handed to every section."""

    args: argparse.Namespace
    console: Console
    device: torch.device
    dtype: torch.dtype
    model: PreTrainedModel
    plan: Plan
    budget: Budget
    out: Path
    results: dict[str, Any]
    arms: list[str]
    """Executor arms this build and device support, in ARM_KWARGS order."""
    peak_flops: float | None
    pytest_proc: subprocess.Popen[str] | None = None
    split_rates: Any = None
    """Rates the first split executor calibrated; later ones reuse them."""
    prefill_samples: list[tuple[int, float]] = field(default_factory=list)
    """(tokens, operator-arm seconds) from the prefill section, for the urgent predictor."""
    memory_limit_tokens: int | None = None
    """Smallest prefill size that did not fit in device memory (later sections stay below)."""

    def fit_tokens(self, wanted: int, prefills: float, seconds: float) -> tuple[int, str | None]:
        """The longest prompt, at most ``wanted`` (halving), below the memory limit and
        whose ``prefills`` prefills are predicted (from the prefill section's operator-arm
        times) to take at most ``seconds``; with a note when it is not ``wanted``."""
        n = min(wanted, int(self.config.max_position_embeddings))
        while n > 16:
            too_big = self.memory_limit_tokens is not None and n >= self.memory_limit_tokens
            if not too_big and extrapolate_s(self.prefill_samples, n, 1.0) * prefills <= seconds:
                break
            n //= 2
        if n == wanted:
            return n, None
        return n, f"{n} tokens instead of {wanted} (memory or time budget)"

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def config(self) -> Any:
        return self.model.config

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def prompt(self, num_tokens: int, seed: int = 0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.args.seed * 1000 + seed)
        return torch.randint(0, int(self.config.vocab_size), (num_tokens,), generator=gen)

    def dim(self, text: str) -> None:
        self.console.print(f"[dim]{text} (t={self.budget.elapsed_s():.0f} s)[/dim]")


def new_table(title: str, columns: Sequence[str], left: int = 0) -> Table:
    """A table whose first ``left`` columns are left-aligned and the rest right-aligned."""
    table = Table(title=title)
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index < left else "right")
    return table


def split_unsupported_reason() -> str | None:
    """None when this build splits operators at run time (the executor takes
    ``max_blocking_ms``), else why the split arm is left out."""
    if "max_blocking_ms" in inspect.signature(PreemptibleExecutor.__init__).parameters:
        return None
    return "PreemptibleExecutor takes no max_blocking_ms: no run-time operator splitting here"


def peak_for(
    device: torch.device, dtype: torch.dtype, override_tflops: float | None
) -> tuple[float | None, str]:
    """Peak FLOP/s for MFU and where it came from (None: MFU not reported)."""
    if override_tflops:
        return override_tflops * 1e12, f"--peak-tflops {override_tflops:g}"
    if device.type != "cuda":
        return None, "CPU: MFU n/a, achieved TFLOP/s only"
    if dtype not in (torch.bfloat16, torch.float16):
        return None, f"{dtype}: MFU only against the bf16/fp16 tensor-core peak"
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12, f"{name}: {tflops:g} TFLOP/s dense bf16 ({key} datasheet)"
    return None, f"{name}: peak unknown, MFU n/a (pass --peak-tflops)"


# ------------------------------------------------------------------------------ model


def build_model(
    name: str, layers: int | None, device: torch.device, dtype: torch.dtype, seed: int
) -> PreTrainedModel:
    """A Llama with random weights, allocated and initialised directly on ``device`` (no
    download, no host copy of the weights)."""
    shape = dict(SHAPES[name])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    config = LlamaConfig(**shape, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _head_dim(config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim or config.hidden_size // config.num_attention_heads)


def prefill_flops(config: Any, n: int) -> float:
    """Matmul FLOPs of one causal prefill of ``n`` tokens: 2 per decoder weight per token,
    4·heads·head_dim per query-key pair of the causal triangle, one ``lm_head`` row."""
    hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = _head_dim(config)
    weights = hidden * (2 * heads + 2 * kv) * head_dim + 3 * hidden * config.intermediate_size
    layers = config.num_hidden_layers
    attention = 4.0 * heads * head_dim * (n * (n + 1) / 2)
    return layers * (2.0 * n * weights + attention) + 2.0 * hidden * config.vocab_size


def prefill_bytes(config: Any, n: int, dtype: torch.dtype) -> float:
    """Rough device memory one prefill needs beyond the weights: its KV cache and one
    layer's live activations (GQA keys expanded), with a 1.3× margin."""
    size = torch.finfo(dtype).bits // 8
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    cache = 2 * config.num_hidden_layers * kv * _head_dim(config) * n * size
    width = 4 * config.hidden_size + 3 * config.intermediate_size
    width += 4 * (heads + kv) * _head_dim(config)
    return 1.3 * (cache + n * width * size)


def memory_note(ctx: Context, n: int, tasks: int = 1) -> str | None:
    """Why ``tasks`` prefills of ``n`` tokens would not fit on the GPU (None: they fit)."""
    if not ctx.cuda:
        return None
    free, _ = torch.cuda.mem_get_info(ctx.device)
    free += torch.cuda.memory_reserved(ctx.device) - torch.cuda.memory_allocated(ctx.device)
    need = tasks * prefill_bytes(ctx.config, n, ctx.dtype)
    if need < 0.9 * free:
        return None
    return f"{n} tokens need ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"


def free_memory(ctx: Context) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.empty_cache()


def extrapolate_s(samples: Sequence[tuple[int, float]], n: int, min_alpha: float = 0.0) -> float:
    """Seconds at ``n`` tokens by a power law through the two largest samples, exponent
    clamped to ``[min_alpha, 2]`` (1 from a single sample); 0 without samples."""
    if not samples:
        return 0.0
    points = sorted(samples)
    n2, t2 = points[-1]
    if n <= n2:
        return max(t for m, t in points if m >= n)
    alpha = max(min_alpha, 1.0)
    if len(points) > 1:
        n1, t1 = points[-2]
        if n1 < n2 and t1 > 0 and t2 > 0:
            alpha = min(2.0, max(min_alpha, math.log(t2 / t1) / math.log(n2 / n1)))
    return t2 * (n / n2) ** alpha


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ----------------------------------------------------------------------- task plumbing


class Probe(TaskControl):
    """A TaskControl that records at every checkpoint, on the task's own thread, when it
    was reached and (CUDA) the current stream and whether that stream had finished its
    work; it parks itself at checkpoint ``park_at`` (drain, ACK, wait for ``resume``)."""

    def __init__(self, name: str, cuda: bool, park_at: int | None = None) -> None:
        super().__init__(name)
        self.cuda = cuda
        self.park_at = park_at
        self.stream: Any = None
        self.stream_ids: set[int] = set()
        self.idle_at_check: list[bool] = []
        self.times_s: list[float] = []
        self.queued_at_park: bool | None = None

    def check(self) -> None:
        self.times_s.append(time.perf_counter())
        if self.cuda:
            stream = torch.cuda.current_stream()
            if self.stream is None:
                self.stream = stream
            self.stream_ids.add(int(stream.cuda_stream))
            self.idle_at_check.append(bool(stream.query()))
        super().check()
        if self.park_at is not None and self.num_checkpoints == self.park_at:
            self.queued_at_park = not self.idle_at_check[-1] if self.cuda else None
            self.park()

    def stream_idle(self) -> bool:
        return self.stream is not None and bool(self.stream.query())


class TaskThread:
    """``executor.run(prompts, control)`` on its own thread, as the execution pool runs it."""

    def __init__(
        self, executor: PreemptibleExecutor, prompts: list[torch.Tensor], control: TaskControl
    ) -> None:
        self.control = control
        self.result: list[PrefillOutput] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._main, args=(executor, prompts), name=control.name, daemon=True
        )

    def _main(self, executor: PreemptibleExecutor, prompts: list[torch.Tensor]) -> None:
        try:
            self.result = executor.run(prompts, self.control)
        except BaseException as err:  # re-raised by join()
            self.error = err
        finally:
            self.control.mark_done()

    def start(self) -> TaskThread:
        self._thread.start()
        return self

    def join(self, timeout_s: float = 600.0) -> list[PrefillOutput]:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.control.name} did not finish in {timeout_s} s")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


@contextmanager
def executor_for(ctx: Context, arm: str) -> Iterator[PreemptibleExecutor]:
    """An executor of ``arm`` on the shared model, closed (unhooked) afterwards."""
    kwargs = dict(ARM_KWARGS[arm])
    splits = "max_blocking_ms" in kwargs
    if splits:
        kwargs["max_blocking_ms"] = ctx.args.max_blocking_ms
        if ctx.split_rates is not None:
            kwargs["split_rates"] = ctx.split_rates
    executor = PreemptibleExecutor(ctx.model, **kwargs)
    try:
        policy = getattr(executor, "split_policy", None)
        if splits and ctx.split_rates is None and policy is not None:
            ctx.split_rates = policy.rates
        yield executor
    finally:
        executor.close()


def same_result(got: PrefillOutput, want: PrefillOutput) -> tuple[bool, float]:
    """(bit-identical?, largest absolute difference over logits and every KV tensor).
    Bits are compared as bytes, so NaNs from random weights compare equal to themselves."""
    pairs = [(got.logits, want.logits)]
    for (gk, gv), (wk, wv) in zip(got.kv_cache, want.kv_cache, strict=True):
        pairs += [(gk, wk), (gv, wv)]
    equal = got.first_token_id == want.first_token_id and all(
        g.shape == w.shape and g.dtype == w.dtype and torch.equal(_bytes(g), _bytes(w))
        for g, w in pairs
    )
    diff = max(float((g.float() - w.float()).abs().max()) for g, w in pairs)
    return equal, diff


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def plain_forward(ctx: Context, prompt: torch.Tensor) -> torch.Tensor:
    """The model as Hugging Face runs it (its own sdpa path, KV cache built) on the current
    stream; float32 logits of the last position."""
    with torch.inference_mode():
        out = ctx.model(input_ids=prompt[None].to(ctx.device), logits_to_keep=1)
        return out.logits[0, -1].float()
