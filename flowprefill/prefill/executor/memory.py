"""What a parked (preempted) task holds in memory: measured once parked, bounded before.

A task parks *inside* its forward pass (:mod:`flowprefill.prefill.executor.preemption`), so what
it holds is exactly the tensors its thread's frames still reference: the packed prompt,
the KV cache filled so far, and the activations of the operator it stopped after. Two
numbers describe that:

* :func:`thread_held_bytes` **measures** it once the task has parked: it walks the parked
  thread's frames and sums the storage bytes of every tensor their locals reach (through
  lists, tuples, dicts, dataclasses and transformers' KV cache objects), each storage
  once, model weights excluded. No tensor is reachable in any other way: the executor runs
  under ``torch.inference_mode`` (no autograd graph keeps activations alive).
* :class:`ParkedFootprint` **bounds** it before the task parks, from the task's token count
  and the model's shape: the KV cache of every token in every layer plus the activations
  live at the widest checkpoint of a pass over all tokens. The scheduler must decide
  whether it may preempt *before* the task parks, so it uses this bound; tests check that
  the measurement never exceeds it at any checkpoint.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

MAX_DEPTH = 4
"""How deep into containers a local is followed (a cache's layers' keys are depth 3)."""


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def weight_storages(model: torch.nn.Module) -> frozenset[tuple[str, int]]:
    """Storages owned by the model (parameters, buffers and tensors modules keep as
    attributes, e.g. prepacked weights): shared by every task, never a task's own."""
    keys: set[tuple[str, int]] = set()
    for module in model.modules():
        tensors: Iterable[Any] = [
            *module.parameters(recurse=False),
            *module.buffers(recurse=False),
            *vars(module).values(),
        ]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                keys.add(_storage_key(t))
    return frozenset(keys)


def _tensors(value: object, depth: int, seen: set[int]) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
        return
    if depth <= 0 or isinstance(value, str | bytes | int | float | torch.nn.Module):
        return
    if id(value) in seen:
        return
    seen.add(id(value))
    children: Iterable[object]
    if isinstance(value, dict):
        children = value.values()
    elif isinstance(value, list | tuple | set | frozenset):
        children = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = (getattr(value, f.name, None) for f in dataclasses.fields(value))
    elif type(value).__module__.startswith("transformers.cache_utils"):
        # DynamicCache -> .layers -> DynamicLayer(.keys, .values)
        children = vars(value).values() if hasattr(value, "__dict__") else ()
    else:
        return
    for child in children:
        yield from _tensors(child, depth - 1, seen)


def frames_held_bytes(frame: FrameType | None, exclude: frozenset[tuple[str, int]]) -> int:
    """Bytes of the distinct tensor storages reachable from ``frame`` and its callers'
    locals, leaving out the storages in ``exclude`` (the weights)."""
    counted: set[tuple[str, int]] = set(exclude)
    seen: set[int] = set()
    total = 0
    while frame is not None:
        for value in list(frame.f_locals.values()):
            for t in _tensors(value, MAX_DEPTH, seen):
                if t.device.type == "meta":
                    continue
                key = _storage_key(t)
                if key not in counted:
                    counted.add(key)
                    total += t.untyped_storage().nbytes()
        frame = frame.f_back
    return total


def thread_held_bytes(thread_id: int, exclude: frozenset[tuple[str, int]] = frozenset()) -> int:
    """:func:`frames_held_bytes` of another thread's stack. Only meaningful while that
    thread is parked (its frames do not change); 0 once the thread has ended."""
    frame = sys._current_frames().get(thread_id)
    return frames_held_bytes(frame, exclude)


def measure_current_thread(exclude: frozenset[tuple[str, int]]) -> Callable[[], int]:
    """A probe the pool calls once this (the task's) thread has parked."""
    ident = threading.get_ident()
    return lambda: thread_held_bytes(ident, exclude)


ACTIVATION_HIDDEN_FACTOR = 6
ACTIVATION_INTERMEDIATE_FACTOR = 3
"""Activations live at the widest checkpoint, per token, in multiples of the hidden and
MLP widths: the residual stream, the normed input, the attention output and the packed q/k/v
(≤ 4 + 2 hidden-widths when kv heads ≤ query heads), and gate, up and their product in the
MLP (3 intermediate-widths). An upper bound, checked against :func:`frames_held_bytes` at
every checkpoint of the tiny models in tests/prefill/executor/test_memory.py."""

TOKEN_INDEX_BYTES = 3 * 8
"""Per token: input ids, position ids and segment indices (int64) of the packed batch."""


@dataclass(frozen=True, slots=True)
class ParkedFootprint:
    """Upper bound on what a parked task of ``n`` tokens holds: ``fixed_bytes +
    n * bytes_per_token`` (plus, per request, its last-position logits)."""

    kv_bytes_per_token: int
    """Keys and values of one token in every layer this process holds."""
    activation_bytes_per_token: int
    logits_bytes_per_request: int

    @classmethod
    def of_model(
        cls, config: Any, dtype: torch.dtype = torch.float32, tp_size: int = 1
    ) -> ParkedFootprint:
        """From a Hugging Face config; ``tp_size`` ranks each hold their share of heads
        (bounded as if the shares were uneven by one head)."""
        elem = dtype.itemsize
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        kv_heads_here = -(-kv_heads // tp_size)
        layers = int(config.num_hidden_layers)
        hidden = max(int(config.hidden_size), heads * head_dim)
        inter = int(getattr(config, "intermediate_size", 0) or 0)
        moe = int(getattr(config, "moe_intermediate_size", 0) or 0)
        top_k = int(getattr(config, "num_experts_per_tok", 1) or 1)
        # A MoE layer's routed tokens go through top_k experts: each token's rows appear
        # top_k times across the experts' gate/up/products.
        width = max(inter, moe * top_k)
        return cls(
            kv_bytes_per_token=2 * layers * kv_heads_here * head_dim * elem,
            activation_bytes_per_token=(
                ACTIVATION_HIDDEN_FACTOR * hidden + ACTIVATION_INTERMEDIATE_FACTOR * width
            )
            * max(elem, 4)
            + TOKEN_INDEX_BYTES,
            logits_bytes_per_request=2 * int(config.vocab_size) * 4,
        )

    def bytes_for(self, num_tokens: int, num_requests: int = 1) -> int:
        per_token = self.kv_bytes_per_token + self.activation_bytes_per_token
        return num_tokens * per_token + num_requests * self.logits_bytes_per_request
