"""Batched and chunked prefill match single-request runs; bad input fails clearly."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from flowprefill.errors import InvalidRequestError, UnknownNameError
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from tests.prefill.executor.helpers import assert_close, random_prompts

MakeExecutor = Callable[..., PreemptibleExecutor]
LENGTHS = [3, 17, 64, 1, 40]


def _reference(model: PreTrainedModel, prompt: list[int]) -> tuple[torch.Tensor, list]:
    """The model called directly, the way transformers runs a single prompt."""
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
    kv = [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]
    return out.logits[0, -1].float(), kv


def test_single_prompt_matches_plain_transformers(
    tiny_model: PreTrainedModel, make_executor: MakeExecutor
) -> None:
    # Reference kernels: the model's own modules (the fast set's oneDNN linears sum in
    # another order; tests/prefill/executor/test_kernels.py compares the two).
    executor = make_executor(tiny_model, kernels="reference")
    prompt = random_prompts([33], executor.vocab_size, seed=10)[0]
    (out,) = executor.prefill([prompt])
    logits, kv = _reference(tiny_model, prompt)
    # lm_head sees one row here and 33 there (different GEMM blocking): not bitwise.
    torch.testing.assert_close(out.logits, logits, atol=1e-6, rtol=1e-5)
    assert out.first_token_id == int(logits.argmax())
    assert out.num_prompt_tokens == 33
    for (k, v), (rk, rv) in zip(out.kv_cache, kv, strict=True):
        assert k.shape == (tiny_model.config.num_key_value_heads, 33, rk.shape[-1])
        assert torch.equal(k, rk)  # the decoder stack itself runs the very same ops
        assert torch.equal(v, rv)


def test_batched_prefill_equals_each_request_alone(
    tiny_model: PreTrainedModel, make_executor: MakeExecutor
) -> None:
    executor = make_executor(tiny_model)
    prompts = random_prompts(LENGTHS, executor.vocab_size, seed=11)
    batched = executor.prefill(prompts)
    assert [o.num_prompt_tokens for o in batched] == LENGTHS
    for prompt, got in zip(prompts, batched, strict=True):
        (alone,) = executor.prefill([prompt])
        assert_close(got, alone)


@pytest.mark.parametrize(("chunk_size", "lengths"), [(1, [3, 5, 1]), (7, LENGTHS), (50, LENGTHS)])
def test_chunked_prefill_equals_unchunked(
    tiny_model: PreTrainedModel, make_executor: MakeExecutor, chunk_size: int, lengths: list[int]
) -> None:
    plain = make_executor(tiny_model)
    prompts = random_prompts(lengths, plain.vocab_size, seed=12)
    want = plain.prefill(prompts) + plain.prefill(prompts[2:3])
    plain.close()
    chunked = make_executor(tiny_model, chunk_size=chunk_size)
    got = chunked.prefill(prompts) + chunked.prefill(prompts[2:3])
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)


@pytest.mark.parametrize(
    ("granularity", "chunk_size", "lengths", "expected"),
    [
        ("operator", None, [10, 20], 10),
        ("layer", None, [10, 20], 2),
        ("none", None, [10, 20], 0),
        ("operator", 8, [10, 20], 4 * 10 + 3),  # 30 tokens → 4 chunks, 3 boundaries
        ("none", 8, [10, 20], 3),  # classic chunked prefill: only between chunks
        ("layer", 100, [10, 20], 2),
    ],
)
def test_expected_checkpoints_match_what_a_run_counts(
    tiny_models: dict[str, PreTrainedModel],
    make_executor: MakeExecutor,
    granularity: str,
    chunk_size: int | None,
    lengths: list[int],
    expected: int,
) -> None:
    executor = make_executor(tiny_models["llama"], granularity=granularity, chunk_size=chunk_size)
    assert executor.expected_checkpoints(lengths) == expected
    control = TaskControl()
    executor.run(random_prompts(lengths, executor.vocab_size, seed=13), control)
    assert control.num_checkpoints == expected
    assert control.num_checkpoints_expected == expected
    assert control.progress == (1.0 if expected else 0.0)


def test_run_accepts_tensors(
    tiny_models: dict[str, PreTrainedModel], make_executor: MakeExecutor
) -> None:
    executor = make_executor(tiny_models["llama"])
    prompt = random_prompts([9], executor.vocab_size, seed=14)[0]
    (a,) = executor.run([torch.tensor(prompt)])
    (b,) = executor.run([prompt])
    assert torch.equal(a.logits, b.logits)


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([], "empty batch"),
        ([[1, 2], []], "prompt 1 is empty"),
        ([[1, 2048]], "token id 2048 outside the vocabulary"),
        ([[-1, 5]], "token id -1 outside the vocabulary"),
        ([[1.5, 2.0]], "integer token ids"),
        ([[[1, 2], [3, 4]]], "flat sequence"),
        ([["a", "b"]], "not a list of token ids"),
        ([[1] * 8193], "8193 tokens; the model supports at most 8192"),
    ],
)
def test_bad_input_gets_a_clear_error(
    tiny_models: dict[str, PreTrainedModel],
    make_executor: MakeExecutor,
    prompts: list,
    message: str,
) -> None:
    executor = make_executor(tiny_models["llama"])
    control = TaskControl()
    with pytest.raises(InvalidRequestError, match=message):
        executor.run(prompts, control)
    assert control.num_checkpoints == 0  # rejected before any device work


def test_bad_configuration_is_rejected(tiny_models: dict[str, PreTrainedModel]) -> None:
    model = tiny_models["llama"]
    with pytest.raises(UnknownNameError, match="granularity 'block'"):
        PreemptibleExecutor(model, granularity="block")
    with pytest.raises(UnknownNameError, match="sync mode 'sometimes'"):
        PreemptibleExecutor(model, sync="sometimes")
    with pytest.raises(ValueError, match="chunk_size"):
        PreemptibleExecutor(model, chunk_size=0)
    PreemptibleExecutor(model).close()  # failed constructions left no hooks behind


def test_executor_restores_the_attention_implementation(make_executor: MakeExecutor) -> None:
    from flowprefill.models import build_model

    model = build_model("llama", "tiny", seed=3)
    model.set_attn_implementation("eager")
    executor = make_executor(model)
    assert model.config._attn_implementation == "flowprefill_packed"
    prompts = random_prompts([5, 12], executor.vocab_size, seed=15)
    batched = executor.prefill(prompts)
    for prompt, got in zip(prompts, batched, strict=True):
        assert_close(got, executor.prefill([prompt])[0])
    executor.close()
    assert model.config._attn_implementation == "eager"


def _patched(model: torch.nn.Module) -> list[str]:
    """What of the executor's patches is left on ``model``: hooks and replaced forwards."""
    return [
        name or "<model>"
        for name, module in model.named_modules()
        if module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__
    ]


def test_a_construction_failing_midway_undoes_every_patch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last step (tracing a forward) fails after every patch was applied: all of them
    are undone, and the model takes a new executor."""
    from flowprefill.models import build_model
    from flowprefill.prefill.executor.splitting import SplitRates

    model = build_model("llama", "tiny", seed=3)
    model.set_attn_implementation("eager")

    def fail(_executor: PreemptibleExecutor) -> None:
        assert _patched(model), "the failure must come after the patches"
        raise RuntimeError("tracing failed")

    with monkeypatch.context() as patch:
        patch.setattr(PreemptibleExecutor, "_trace_forward", fail)
        with pytest.raises(RuntimeError, match="tracing failed"):
            PreemptibleExecutor(model, max_blocking_ms=5.0, split_rates=SplitRates(1e9, 1e9))
    assert _patched(model) == []
    assert model.config._attn_implementation == "eager"
    executor = PreemptibleExecutor(model, max_blocking_ms=5.0, split_rates=SplitRates(1e9, 1e9))
    assert _patched(model) != []
    executor.close()
    executor.close()  # closing again does nothing
    assert _patched(model) == []
    assert model.config._attn_implementation == "eager"
