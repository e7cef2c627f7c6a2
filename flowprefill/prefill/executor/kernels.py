"""Faster CPU kernels for the executor's forward pass: oneDNN linears on prepacked weights.

On CPU, ``nn.Linear`` in float32 runs MKL's sgemm. On AMD EPYC CPUs MKL takes a slower code
path than oneDNN (bundled with PyTorch): single-threaded, a ``[2048, 512] × [512, 1024]``
projection runs at ~68 GFLOP/s with MKL and ~90 GFLOP/s with oneDNN on a weight reordered
once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` /
``_linear_pointwise``, the pair torch.compile's CPU backend uses for frozen linears). The
decoder projections are most of a prefill's time, so this is the largest lever available
without changing the model's arithmetic (still float32 FMAs, just a different summation
order: results agree with MKL's to ~1e-6 relative, not bitwise).

:func:`install_fast_linears` packs the weight of every ``nn.Linear`` inside the decoder
layers once and points the module's ``forward`` at a function that uses the packed weight
**only while** ``fast_kernels`` is set in the calling thread's context
(:mod:`flowprefill.prefill.executor.context`; the executor sets it for its own forward
passes). Anywhere else — another thread, a direct ``model(...)`` call — the module runs
plain ``F.linear`` on its own weight, so the model is unchanged for every other user.
Module hooks (the preemption checkpoints) still fire: the module is still called, only its
body differs. ``lm_head`` is left alone (it sees one row per request).

The packed copy duplicates the decoder's linear weights in memory (54 MB for demo-llama).
Weights are assumed frozen while installed: a module whose weight was replaced or modified
in place since packing silently falls back to ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional

from flowprefill.contracts.names import Kernels
from flowprefill.prefill.executor.context import thread_context


def resolve_kernels(kernels: str | Kernels | None) -> Kernels:
    """``kernels`` parsed by :meth:`Kernels.parse`; None means fast.

    The executor reads no environment: ``$FLOWPREFILL_KERNELS`` is resolved once, by
    :meth:`flowprefill.contracts.EngineConfig.resolved_kernels`."""
    return Kernels.FAST if kernels is None else Kernels.parse(kernels)


def onednn_linear_supported(weight: torch.Tensor) -> bool:
    """Packed oneDNN linears are used for float32 weights on CPU only."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


@dataclass
class FastLinearHandle:
    """Modules whose ``forward`` was replaced; :meth:`remove` restores them."""

    modules: list[nn.Linear] = field(default_factory=list)

    @property
    def num_packed(self) -> int:
        return len(self.modules)

    def remove(self) -> None:
        for module in self.modules:
            # The replacement is an instance attribute shadowing nn.Linear.forward.
            module.__dict__.pop("forward", None)
        self.modules.clear()


def _packed_forward(module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    weight = module.weight
    version = weight._version
    bias = module.bias.detach() if module.bias is not None else None
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    linear_pointwise = torch.ops.mkldnn._linear_pointwise
    context = thread_context

    def forward(input: torch.Tensor) -> torch.Tensor:
        if (
            context.fast_kernels
            and input.dtype == torch.float32
            and module.weight is weight
            and weight._version == version
        ):
            return linear_pointwise(input, packed, bias, "none", [], "")
        return functional.linear(input, module.weight, module.bias)

    return forward


def install_fast_linears(layers: nn.Module) -> FastLinearHandle:
    """Pack every plain ``nn.Linear`` under ``layers`` (the decoder stack).

    Subclasses of ``nn.Linear`` (quantised or LoRA layers, ...) and unsupported
    dtypes/devices are left alone; the handle lists what was replaced.
    """
    handle = FastLinearHandle()
    with torch.no_grad():
        for module in layers.modules():
            if type(module) is not nn.Linear or "forward" in module.__dict__:
                continue
            if not onednn_linear_supported(module.weight):
                continue
            module.forward = _packed_forward(module)  # type: ignore[method-assign,assignment]
            handle.modules.append(module)
    return handle
