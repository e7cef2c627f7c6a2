"""Install preemption checkpoints on a Hugging Face causal LM without editing model code.

A checkpoint is a PyTorch module hook that calls ``on_boundary`` (by default
:func:`flowprefill.prefill.executor.context.checkpoint`). Hooks are installed once per model and
serve every task thread: the checkpoint finds its task through a thread-local, so a thread
with no active task pays one attribute lookup per boundary.

Granularities:

- ``operator`` (the paper's default): per decoder layer, after the q/k/v projections (after
  the last of them, or after a fused ``qkv_proj``), after attention (a *pre*-hook of
  ``o_proj``: attention is a function call inside the attention module, not a module),
  after ``o_proj``, after gate+up (after ``up_proj`` or a fused ``gate_up_proj``), after
  ``down_proj``; for MoE layers, after the router gate and after the experts.
- ``layer``: after each decoder layer.
- ``none``: no hooks (chunk boundaries, if any, remain checkpoints; see the runner).

Placement is chosen per model family (``config.model_type``), with a name-based fallback
for unknown families; a model with no recognisable boundaries is rejected with
:class:`NoBoundariesError` rather than silently running without checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from flowprefill.contracts.names import Granularity
from flowprefill.errors import FlowPrefillError
from flowprefill.prefill.executor.context import checkpoint

_INSTALLED_ATTR = "_flowprefill_checkpoints"


class NoBoundariesError(FlowPrefillError, ValueError):
    """The model's modules do not match any known operator-boundary layout."""


@dataclass(frozen=True)
class Boundary:
    """One operator boundary inside a decoder layer.

    ``candidates`` are module paths relative to the layer; the first one present is used.
    ``pre`` places the checkpoint before the module runs instead of after.
    """

    name: str
    candidates: tuple[str, ...]
    pre: bool = False


Variant = tuple[Boundary, ...]

_ATTENTION: Variant = (
    Boundary("qkv_proj", ("self_attn.qkv_proj", "self_attn.v_proj")),
    Boundary("attn", ("self_attn.o_proj",), pre=True),
    Boundary("o_proj", ("self_attn.o_proj",)),
)
_DENSE_MLP: Variant = (
    Boundary("gate_up_proj", ("mlp.gate_up_proj", "mlp.up_proj")),
    Boundary("down_proj", ("mlp.down_proj",)),
)
_MOE_MLP: Variant = (
    Boundary("router", ("mlp.gate",)),
    Boundary("experts", ("mlp.experts",)),
)


@dataclass(frozen=True)
class Layout:
    """Boundaries of a family: attention, then the first MLP variant a layer matches.

    MoE families list the dense variant too: Qwen3-MoE can mix dense layers
    (``mlp_only_layers``, ``decoder_sparse_step``).
    """

    attention: Variant
    mlp_variants: tuple[Variant, ...]


_DENSE = Layout(_ATTENTION, (_DENSE_MLP,))
_MOE = Layout(_ATTENTION, (_MOE_MLP, _DENSE_MLP))

FAMILY_LAYOUTS: dict[str, Layout] = {
    "llama": _DENSE,
    "mistral": _DENSE,
    "qwen2": _DENSE,
    "qwen3": _DENSE,
    "qwen3_moe": _MOE,
    "mixtral": _MOE,
}

# Name-based fallback for families not in the table (GPT-NeoX, Phi, Falcon, Mixtral's
# older ``block_sparse_moe``, ...). Each boundary tries the common spellings.
_OUT_PROJ_NAMES = (
    "self_attn.o_proj",
    "self_attn.dense",  # Phi
    "attention.dense",  # GPT-NeoX
    "self_attention.dense",  # Falcon, Bloom
    "attn.c_proj",  # GPT-2
)
_FALLBACK = Layout(
    attention=(
        Boundary(
            "qkv_proj",
            (
                "self_attn.qkv_proj",
                "self_attn.v_proj",
                "attention.query_key_value",
                "self_attention.query_key_value",
                "attn.c_attn",
            ),
        ),
        Boundary("attn", _OUT_PROJ_NAMES, pre=True),
        Boundary("o_proj", _OUT_PROJ_NAMES),
    ),
    mlp_variants=(
        _MOE_MLP,
        (
            Boundary("router", ("block_sparse_moe.gate",)),
            Boundary("experts", ("block_sparse_moe.experts",)),
        ),
        (
            Boundary(
                "gate_up_proj",
                ("mlp.gate_up_proj", "mlp.up_proj", "mlp.dense_h_to_4h", "mlp.fc1", "mlp.c_fc"),
            ),
            Boundary("down_proj", ("mlp.down_proj", "mlp.dense_4h_to_h", "mlp.fc2", "mlp.c_proj")),
        ),
    ),
)


@dataclass(frozen=True)
class PlacedCheckpoint:
    """A checkpoint as installed: decoder layer index, boundary name, module path."""

    layer_index: int
    boundary: str
    module_path: str
    pre: bool


@dataclass
class CheckpointHandle:
    """Installed checkpoints of one model; :meth:`remove` uninstalls them."""

    granularity: Granularity
    placed: list[PlacedCheckpoint]
    _model: nn.Module
    _hooks: list[RemovableHandle] = field(default_factory=list)

    @property
    def num_checkpoints_per_forward(self) -> int:
        """How many times the hooks fire in one forward pass (every hooked module runs
        exactly once per forward in the supported layouts, MoE experts included)."""
        return len(self.placed)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if getattr(self._model, _INSTALLED_ATTR, None) is self:
            delattr(self._model, _INSTALLED_ATTR)

    def __enter__(self) -> CheckpointHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def check_granularity(granularity: str | Granularity) -> Granularity:
    """``granularity`` parsed by :meth:`Granularity.parse` (operator, layer or none)."""
    return Granularity.parse(granularity)


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's stack of decoder layers and its path.

    The standard HF layout is ``<base>.layers``; otherwise the ModuleList whose length is
    ``config.num_hidden_layers`` (or the longest one) is taken.
    """
    lists = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList)]
    for name, mod in lists:
        if name.endswith(".layers") or name == "layers":
            return name, mod
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    matching = [(n, m) for n, m in lists if len(m) == num_layers] or lists
    if not matching:
        raise NoBoundariesError(f"{type(model).__name__} has no list of decoder layers")
    return max(matching, key=lambda item: len(item[1]))


def plan_checkpoints(model: nn.Module, granularity: str | Granularity) -> list[PlacedCheckpoint]:
    """Where checkpoints go, in the order they fire during a forward pass."""
    granularity = check_granularity(granularity)
    if granularity is Granularity.NONE:
        return []
    layers_path, layers = find_decoder_layers(model)
    if granularity is Granularity.LAYER:
        return [
            PlacedCheckpoint(i, "layer", f"{layers_path}.{i}", pre=False)
            for i in range(len(layers))
        ]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    layout = FAMILY_LAYOUTS.get(str(model_type), _FALLBACK)
    placed: list[PlacedCheckpoint] = []
    for index, layer in enumerate(layers):
        prefix = f"{layers_path}.{index}"
        attention = _resolve(layer, layout.attention)
        mlp = next(
            (r for r in (_resolve(layer, v) for v in layout.mlp_variants) if r is not None), None
        )
        if attention is None or mlp is None:
            part = "attention" if attention is None else "MLP"
            raise NoBoundariesError(
                f"no recognisable {part} operator boundaries in {prefix} "
                f"({type(layer).__name__}, model_type={model_type!r}); children: "
                f"{sorted(n for n, _ in layer.named_modules() if n)[:20]}. Use granularity "
                "'layer' or add a layout to FAMILY_LAYOUTS."
            )
        placed.extend(
            PlacedCheckpoint(index, b.name, f"{prefix}.{path}", b.pre)
            for b, path in attention + mlp
        )
    return placed


def _resolve(layer: nn.Module, variant: Variant) -> list[tuple[Boundary, str]] | None:
    """Module path per boundary, or None if any boundary of the variant is missing."""
    names = {name for name, _ in layer.named_modules()}
    resolved: list[tuple[Boundary, str]] = []
    for boundary in variant:
        path = next((c for c in boundary.candidates if c in names), None)
        if path is None:
            return None
        resolved.append((boundary, path))
    return resolved


def install_checkpoints(
    model: nn.Module,
    granularity: str | Granularity = Granularity.OPERATOR,
    on_boundary: Callable[[], None] = checkpoint,
) -> CheckpointHandle:
    """Register the hooks for ``granularity``; remove them with ``handle.remove()``.

    ``on_boundary`` is what each hook calls. Installing twice on one model is refused: the
    second set would fire alongside the first and double every count.
    """
    granularity = check_granularity(granularity)
    placed = plan_checkpoints(model, granularity)
    existing = getattr(model, _INSTALLED_ATTR, None)
    if existing is not None:
        raise RuntimeError(
            f"checkpoints ({existing.granularity}) are already installed on this model; "
            "remove them first"
        )
    modules = dict(model.named_modules())
    handle = CheckpointHandle(granularity, placed, model)

    # Tiny closures: the hook is on the hot path of every operator, so no per-call lookups
    # beyond calling ``on_boundary``.
    def post_hook(_module: nn.Module, _args: Any, _output: Any) -> None:
        on_boundary()

    def pre_hook(_module: nn.Module, _args: Any) -> None:
        on_boundary()

    for spot in placed:
        module = modules[spot.module_path]
        if spot.pre:
            handle._hooks.append(module.register_forward_pre_hook(pre_hook))
        else:
            handle._hooks.append(module.register_forward_hook(post_hook))
    setattr(model, _INSTALLED_ATTR, handle)
    return handle


def describe(placed: Sequence[PlacedCheckpoint]) -> list[str]:
    """Human-readable labels, e.g. ``'0:attn (pre model.layers.0.self_attn.o_proj)'``."""
    return [
        f"{p.layer_index}:{p.boundary} ({'pre' if p.pre else 'post'} {p.module_path})"
        for p in placed
    ]
