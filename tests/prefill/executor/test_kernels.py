"""Fast kernels (oneDNN linears on packed weights): used only inside the executor, close to
the reference kernels, and still bit-identical across preemption."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.profiler import profile
from transformers import PreTrainedModel

from flowprefill.contracts.deployment import KERNELS_ENV
from flowprefill.contracts.names import Kernels
from flowprefill.errors import UnknownNameError
from flowprefill.models import ModelSize, build_model
from flowprefill.prefill.executor.kernels import resolve_kernels
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from tests.prefill.executor.helpers import (
    StopAt,
    TaskThread,
    assert_bit_identical,
    assert_close,
    random_prompts,
)

MakeExecutor = Callable[..., PreemptibleExecutor]

# Wide enough that oneDNN and MKL sum in different orders (at hidden 64 they agree
# bitwise), small enough to stay fast.
_WIDER = ModelSize(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=2048,
    moe_intermediate_size=128,
)


@pytest.fixture(scope="module")
def wider_models() -> dict[str, PreTrainedModel]:
    return {f: build_model(f, _WIDER, seed=2) for f in ("llama", "qwen2", "qwen3-moe")}


def _linear_ops(fn: Callable[[], object]) -> set[str]:
    with profile() as prof:
        fn()
    return {e.key for e in prof.key_averages() if "linear" in e.key or e.key == "aten::mm"}


def test_fast_linears_are_used_only_inside_the_executor(make_executor: MakeExecutor) -> None:
    model = build_model("llama", _WIDER, seed=4)
    ids = torch.tensor([random_prompts([40], 2048, seed=1)[0]])
    with torch.inference_mode():
        before = model(ids).logits
    executor = make_executor(model, kernels="fast")
    linears = [m for m in model.model.layers.modules() if type(m) is nn.Linear]
    assert executor._linears.num_packed == len(linears) == 7 * 2
    assert "mkldnn::_linear_pointwise" in _linear_ops(lambda: executor.prefill([ids[0]]))
    with torch.inference_mode():
        # A direct call, even while the executor is open, runs the model's own linears.
        assert "mkldnn::_linear_pointwise" not in _linear_ops(lambda: model(ids))
        assert torch.equal(model(ids).logits, before)
    executor.close()
    assert all("forward" not in m.__dict__ for m in linears)


def test_reference_kernels_use_no_packed_weights(make_executor: MakeExecutor) -> None:
    model = build_model("llama", _WIDER, seed=4)
    executor = make_executor(model, kernels="reference")
    assert executor._linears.num_packed == 0
    ops = _linear_ops(lambda: executor.prefill([[1, 2, 3, 4]]))
    assert "mkldnn::_linear_pointwise" not in ops


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3-moe"])
def test_fast_matches_reference(
    wider_models: dict[str, PreTrainedModel], make_executor: MakeExecutor, family: str
) -> None:
    model = wider_models[family]
    prompts = random_prompts([150, 7, 60], 2048, seed=3)
    reference = make_executor(model, kernels="reference")
    want = reference.prefill(prompts)
    reference.close()
    fast = make_executor(model, kernels="fast", chunk_size=64)
    got = fast.prefill(prompts)
    assert not all(torch.equal(g.logits, w.logits) for g, w in zip(got, want, strict=True))
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3-moe"])
def test_fast_kernels_resume_bit_identically(
    wider_models: dict[str, PreTrainedModel], make_executor: MakeExecutor, family: str
) -> None:
    """A preempted by B (which runs to completion) at two operator boundaries."""
    executor = make_executor(wider_models[family], granularity="operator", kernels="fast")
    prompts_a = random_prompts([120, 33], 2048, seed=5)
    prompts_b = random_prompts([80], 2048, seed=6)
    solo_a, solo_b = executor.prefill(prompts_a), executor.prefill(prompts_b)
    stops = [2, executor.num_checkpoints_per_forward - 1]
    a = TaskThread(executor, prompts_a, StopAt("A", at=stops)).start()
    control = a.control
    assert isinstance(control, StopAt)
    for stop in stops:
        control.preempt_at(stop)
        assert_bit_identical(
            TaskThread(executor, prompts_b, TaskControl("B")).start().join(), solo_b
        )
        control.resume()
    assert_bit_identical(a.join(), solo_a)


def test_modified_weight_falls_back_to_the_module(make_executor: MakeExecutor) -> None:
    model = build_model("llama", _WIDER, seed=7)
    executor = make_executor(model, kernels="fast")
    prompt = random_prompts([30], 2048, seed=8)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2.0)  # packed copy is now stale
    got = executor.prefill(prompt)[0]
    executor.close()
    want = make_executor(model, kernels="reference").prefill(prompt)[0]
    assert_close(got, want)


def test_kernel_set_names(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_kernels(None) is Kernels.FAST
    assert resolve_kernels("reference") is Kernels.REFERENCE
    assert resolve_kernels("REFERENCE") is Kernels.REFERENCE
    with pytest.raises(UnknownNameError, match="kernels 'turbo'"):
        resolve_kernels("turbo")
    # The executor reads no environment; EngineConfig.resolved_kernels() does, once.
    monkeypatch.setenv(KERNELS_ENV, "reference")
    assert resolve_kernels(None) is Kernels.FAST
