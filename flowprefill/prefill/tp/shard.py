"""One tensor-parallel rank's shard of a Hugging Face causal LM, read from its checkpoint.

Megatron-style split of every decoder layer over ``world`` ranks:

==========================  =====================  ====================================
parameter                   split                  why
==========================  =====================  ====================================
``q_proj`` / ``k_proj`` /   rows (output features)  each rank owns whole attention heads:
``v_proj`` (+ bias)         = heads                 ``num_heads / world`` query heads and
                                                    ``num_kv_heads / world`` KV heads, so
                                                    attention needs no communication
``o_proj``                  columns (input)         partial sums, all-reduced after it
``gate_proj`` / ``up_proj`` rows                    each rank owns an intermediate slice
``down_proj``               columns                 partial sums, all-reduced after it
MoE ``experts``             every expert's          experts sharded (not replicated): the
                            intermediate slice      router is replicated, so every rank
                                                    picks the same experts for a token;
                                                    one all-reduce after ``experts``
embedding, ``lm_head``,     replicated              see below
norms, router, q/k norms
==========================  =====================  ====================================

Embedding and ``lm_head`` are replicated, not vocabulary-parallel: a prefill sends only the
last row of each request to ``lm_head`` (one row, not the prompt), so sharding it saves no
time worth an extra collective at the end of every forward, and a replicated embedding
needs no masked lookup plus all-reduce before the first layer. The cost is memory: both
matrices whole on every rank (Llama-3-70B in bf16: 2 × 128256 × 8192 × 2 B = 4.2 GB per
rank, against 1.05 GB at TP4 if they were sharded).

Row-parallel biases (``o_proj``, ``down_proj`` with ``mlp_bias``) are kept on rank 0 only,
so the all-reduced sum adds them once.

Loading never materialises the whole model: the module tree is built on the meta device,
and each parameter is read from the safetensors files already sliced to this rank
(``safe_open(...).get_slice``), so a rank's host memory holds its shard plus the replicated
parts. Hub-style MoE checkpoints (one ``experts.<e>.{gate,up,down}_proj`` tensor per
expert) are assembled into transformers' fused ``experts.gate_up_proj`` / ``down_proj``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from flowprefill.errors import InvalidRequestError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
"""Families whose checkpoint names and module layout the split below knows."""

_COLUMN = re.compile(r"\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.(weight|bias)$")
_REDUCED_AFTER = (".self_attn.o_proj", ".mlp.down_proj", ".mlp.experts")
"""Modules whose outputs are partial sums on each rank (row-parallel, sharded experts)."""
_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


class TPConfigError(InvalidRequestError):
    """The model cannot be split ``world`` ways (heads or sizes not divisible, family)."""


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world``."""

    rank: int
    world: int

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"bad tensor-parallel rank {self.rank} of {self.world}")

    def part(self, size: int) -> slice:
        """This rank's contiguous slice of ``size`` (divisible by ``world``)."""
        step = size // self.world
        return slice(self.rank * step, (self.rank + 1) * step)


def check_splittable(config: Any, world: int) -> None:
    """Raise :class:`TPConfigError` naming the number that does not divide by ``world``."""
    model_type = str(getattr(config, "model_type", "?"))
    if world == 1:
        return
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TPConfigError(
            f"tensor parallelism supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"this model is {model_type!r} (run it with tp_size=1)"
        )
    heads = int(config.num_attention_heads)
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "intermediate_size": int(config.intermediate_size),
    }
    moe = getattr(config, "moe_intermediate_size", None)
    if moe is not None:
        sizes["moe_intermediate_size"] = int(moe)
    for name, value in sizes.items():
        if value % world:
            raise TPConfigError(
                f"tp_size={world} does not divide the model's {name}={value}: every rank must "
                f"hold whole heads and equal slices (choose a tp_size dividing {value})"
            )


@dataclass
class AllReduceHandle:
    """The all-reduce hooks after the row-parallel modules; :meth:`remove` detaches them."""

    modules: list[str] = field(default_factory=list)
    _hooks: list[Any] = field(default_factory=list)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def install_all_reduces(
    model: nn.Module, group: Callable[[], Any] | None = None
) -> AllReduceHandle:
    """Sum the partial outputs of ``o_proj``, dense ``down_proj`` and MoE ``experts``.

    Installed as forward hooks before the executor's checkpoint hooks (hooks run in
    registration order), so a checkpoint after ``o_proj`` sees the reduced output.
    ``group()`` names the process group (None: the default group).
    """
    handle = AllReduceHandle()

    def reduce(_module: nn.Module, _args: Any, output: Any) -> Any:
        dist.all_reduce(output, group=group() if group is not None else None)
        return output

    for name, module in model.named_modules():
        if not name.endswith(_REDUCED_AFTER):
            continue
        handle._hooks.append(module.register_forward_hook(reduce))
        handle.modules.append(name)
    return handle


class _Checkpoint:
    """Lazy, sliced reads from a (possibly sharded) safetensors checkpoint directory."""

    def __init__(self, path: Path, stack: ExitStack) -> None:
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (path / "model.safetensors").exists():
            weight_map = {}
            with safe_open(str(path / "model.safetensors"), "pt") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise TPConfigError(f"{path} holds no model.safetensors (or index): cannot shard it")
        self._files = {
            name: stack.enter_context(safe_open(str(path / name), "pt"))
            for name in sorted(set(weight_map.values()))
        }
        self._where = weight_map

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> list[int]:
        return list(self._files[self._where[key]].get_slice(key).get_shape())

    def read(self, key: str, *index: slice) -> torch.Tensor:
        """``key``, sliced by ``index`` per leading dimension (full when omitted)."""
        if key not in self._where:
            raise TPConfigError(f"checkpoint has no tensor {key!r}")
        part = self._files[self._where[key]].get_slice(key)
        return part[index] if index else part[:]


def _expert_keys(prefix: str, expert: int, proj: str) -> str:
    return f"{prefix}.{expert}.{proj}.weight"


def _read_param(
    ckpt: _Checkpoint, name: str, shape: torch.Size, shard: Shard, config: Any
) -> torch.Tensor:
    """The tensor this rank holds for model parameter ``name``."""
    if _COLUMN.search(name):
        return ckpt.read(name, shard.part(int(ckpt.shape(name)[0])))
    if _ROW.search(name):
        if name.endswith(".bias"):
            full = ckpt.read(name)
            return full if shard.rank == 0 else torch.zeros_like(full)
        return ckpt.read(name, slice(None), shard.part(int(ckpt.shape(name)[1])))
    match = _EXPERTS.search(name)
    if match:
        return _read_experts(ckpt, name, match.group(1), shard, config)
    if name in ckpt:
        return ckpt.read(name)
    raise TPConfigError(f"checkpoint has no tensor for parameter {name!r} (shape {tuple(shape)})")


def _read_experts(
    ckpt: _Checkpoint, name: str, which: str, shard: Shard, config: Any
) -> torch.Tensor:
    """Fused expert weights [E, 2I/world, H] or [E, H, I/world] from fused or per-expert keys."""
    inter = int(config.moe_intermediate_size)
    mine = shard.part(inter)
    if name in ckpt:  # already fused in the checkpoint
        if which == "down_proj":
            return ckpt.read(name, slice(None), slice(None), mine)
        gate = ckpt.read(name, slice(None), slice(mine.start, mine.stop))
        up = ckpt.read(name, slice(None), slice(inter + mine.start, inter + mine.stop))
        return torch.cat([gate, up], dim=1)
    prefix = name.rsplit(".", 1)[0]
    experts = int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0))
    parts = []
    for e in range(experts):
        if which == "down_proj":
            parts.append(ckpt.read(_expert_keys(prefix, e, "down_proj"), slice(None), mine))
        else:
            gate = ckpt.read(_expert_keys(prefix, e, "gate_proj"), mine)
            up = ckpt.read(_expert_keys(prefix, e, "up_proj"), mine)
            parts.append(torch.cat([gate, up], dim=0))
    return torch.stack(parts)


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    for module_name, module in model.named_modules():
        for local, param in module.named_parameters(recurse=False):
            yield f"{module_name}.{local}" if module_name else local, module, local, param


def load_shard(
    path: str | Path,
    shard: Shard,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """Rank ``shard.rank``'s part of the model at ``path`` (a Hugging Face directory), in
    eval mode with sdpa attention, on ``device``. No collective runs here; install the
    all-reduces with :func:`install_all_reduces`."""
    path = Path(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_splittable(config, shard.world)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    target = torch.device(device)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    with ExitStack() as stack:
        ckpt = _Checkpoint(path, stack)
        for name, module, local, param in list(_named_tensors(model)):
            if tied and name == "lm_head.weight" and name not in ckpt:
                continue  # tied below
            tensor = _read_param(ckpt, name, param.shape, shard, config)
            module._parameters[local] = nn.Parameter(
                tensor.to(device=target, dtype=dtype), requires_grad=False
            )
    if tied:
        model.tie_weights()
    _rebuild_rotary(model, target)
    leftover = [n for n, _, _, p in _named_tensors(model) if p.is_meta]
    leftover += [n for n, b in model.named_buffers() if b.is_meta]
    if leftover:
        raise TPConfigError(f"could not load {', '.join(leftover[:5])} from {path}")
    model.eval()
    return model


def _rebuild_rotary(model: nn.Module, device: torch.device) -> None:
    """Rotary embeddings keep ``inv_freq`` as a non-persistent buffer (not in the
    checkpoint): build those modules again, for real, from the config."""
    for name, module in list(model.named_modules()):
        if "inv_freq" not in module._buffers:
            continue
        rebuilt = type(module)(config=module.config)
        rebuilt.to(device)
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, rebuilt)
