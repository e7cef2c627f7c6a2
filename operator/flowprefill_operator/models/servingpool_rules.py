"""A ServingPool spec's cross-field rules: each rule's refusal message, its CEL (the CRD's
copy, which the API server enforces: :data:`SPEC_RULES`), and the vLLM argument spellings
the rules look for.

The Python copy of the same rules is ``ServingPoolSpec._mirror_cel``
(:mod:`flowprefill_operator.models.servingpool`): it raises these messages, so a pool
refused by the API server and one refused by the operator read the same. A rule changed
here must change there too.
"""

from __future__ import annotations

from pydantic.json_schema import JsonValue

from flowprefill.contracts.nixl import CPU_BLOCK_MULTIPLE

from .autoscaling import OPERATOR_NEEDS_AUTOSCALING
from .common import cel
from .kvhandoff import nixl_cel

ENGINE_ROLE_ONLY = "engine applies to role=prefill or colocated"
VLLM_ARGS_ROLE_ONLY = "vllmArgs applies to role=decode or colocated"
VLLM_ROLE_ONLY = "vllm applies to role=decode or colocated"
PREFILL_TP_REFUSED = (
    "engine.tpSize must not exceed resources.gpusPerPod when engine.device is cuda: each "
    "rank of the pod's engine drives a GPU of its own (an unset engine runs cuda, tpSize 1)"
)
COLOCATED_ONLY = "colocated applies to role=colocated"
COLOCATED_DEVICE = (
    "a colocated pool runs the engine where vLLM runs: engine.device cuda with "
    "resources.gpusPerPod above 0, engine.device cpu with gpusPerPod 0 (an unset engine "
    "runs cuda)"
)
COLOCATED_MEMORY_ARG = (
    "set a colocated pool's vLLM memory share with colocated.decodeMemoryFraction, not "
    "--gpu-memory-utilization in vllmArgs (the operator renders it from the split)"
)
GPU_MEMORY_ARG_PREFIXES = ("--gpu-memory-utilization", "--gpu_memory_utilization")
DECODE_TP_REFUSED = (
    "vllm.tensorParallelSize must not exceed resources.gpusPerPod: each vLLM rank drives a "
    "GPU of its own (gpusPerPod 0: vLLM's CPU backend)"
)
VLLM_ARGS_TP_REFUSED = (
    "set the tensor-parallel degree with vllm.tensorParallelSize, not in vllmArgs (the "
    "operator sizes the pod's GPUs and /dev/shm from it)"
)
TP_ARG_PREFIXES = ("--tensor-parallel", "--tensor_parallel", "-tp=")
TP_SHORT_FLAG = "-tp"
"""vLLM's spellings of its tensor-parallel flag: ``--tensor-parallel-size 2``, its
abbreviations and underscore form, ``-tp 2``, ``-tp=2``."""


GPU_CEL = (
    "(self.role == 'prefill' ? (!has(self.engine) || self.engine.device == 'cuda')"
    " : self.resources.gpusPerPod > 0)"
)
"""CEL: the pool runs on GPUs (``ServingPoolSpec.on_gpu``)."""
NIXL_CEL = nixl_cel(GPU_CEL)
KV_TRANSPORT_NEEDED = (
    "claimName is required with transport sharedDir, the default of kvHandoff on a pool "
    "without GPUs: set kvHandoff.transport (nixl, http) or kvHandoff.claimName"
)
NIXL_BLOCK_SIZE_ARG = (
    "with transport nixl set the block size with kvHandoff.nixl.blockSize, not --block-size "
    "in vllmArgs (the operator passes it to decode and to prefill alike)"
)
NIXL_CPU_BLOCK_SIZE = (
    f"kvHandoff.nixl.blockSize must be a multiple of {CPU_BLOCK_MULTIPLE} on a pool without "
    "GPUs (vLLM's CPU attention backend)"
)
RDMA_NOT_GPU = (
    "kvHandoff.nixl.rdma.resources must not name resources.gpuResourceName "
    "(set GPUs with resources.gpusPerPod)"
)
BLOCK_SIZE_ARG_PREFIXES = ("--block-size=", "--block_size")
BLOCK_SIZE_FLAG = "--block-size"


def sets_block_size(arg: str) -> bool:
    """Whether a vLLM argument sets ``--block-size`` (the CRD's rule, in Python)."""
    return arg == BLOCK_SIZE_FLAG or arg.startswith(BLOCK_SIZE_ARG_PREFIXES)


def sets_tensor_parallel(arg: str) -> bool:
    """Whether a vLLM argument sets the tensor-parallel degree (the CRD's rule, in Python)."""
    return arg == TP_SHORT_FLAG or arg.startswith(TP_ARG_PREFIXES)


SPEC_RULES: list[JsonValue] = [
    cel("self.role != 'decode' || !has(self.engine)", ENGINE_ROLE_ONLY),
    cel(
        "self.role != 'prefill' || !has(self.vllmArgs) || size(self.vllmArgs) == 0",
        VLLM_ARGS_ROLE_ONLY,
    ),
    cel("self.role != 'prefill' || !has(self.vllm)", VLLM_ROLE_ONLY),
    cel("self.role == 'colocated' || !has(self.colocated)", COLOCATED_ONLY),
    cel(
        "self.role != 'colocated' || (has(self.engine) ? self.engine.device == 'cuda'"
        " : true) == (self.resources.gpusPerPod > 0)",
        COLOCATED_DEVICE,
    ),
    cel(
        "self.role != 'colocated' || !has(self.vllmArgs) || !self.vllmArgs.exists(a, "
        + " || ".join(f"a.startsWith('{p}')" for p in GPU_MEMORY_ARG_PREFIXES)
        + ")",
        COLOCATED_MEMORY_ARG,
    ),
    cel(
        "self.role == 'decode' || (has(self.engine) ? self.engine.device != 'cuda'"
        " || self.engine.tpSize <= self.resources.gpusPerPod"
        " : self.resources.gpusPerPod >= 1)",
        PREFILL_TP_REFUSED,
    ),
    cel(
        "!has(self.vllm) || self.resources.gpusPerPod == 0"
        " || self.vllm.tensorParallelSize <= self.resources.gpusPerPod",
        DECODE_TP_REFUSED,
    ),
    cel(
        "!has(self.vllmArgs) || !self.vllmArgs.exists(a, "
        f"a == '{TP_SHORT_FLAG}' || "
        + " || ".join(f"a.startsWith('{p}')" for p in TP_ARG_PREFIXES)
        + ")",
        VLLM_ARGS_TP_REFUSED,
    ),
    cel(
        "!has(self.kvHandoff) || has(self.kvHandoff.transport)"
        " || has(self.kvHandoff.claimName) || has(self.kvHandoff.nixl) || " + GPU_CEL,
        KV_TRANSPORT_NEEDED,
    ),
    cel(
        f"!{NIXL_CEL} || !has(self.vllmArgs) || !self.vllmArgs.exists(a, "
        f"a == '{BLOCK_SIZE_FLAG}' || "
        + " || ".join(f"a.startsWith('{p}')" for p in BLOCK_SIZE_ARG_PREFIXES)
        + ")",
        NIXL_BLOCK_SIZE_ARG,
    ),
    cel(
        f"!{NIXL_CEL} || {GPU_CEL} || !has(self.kvHandoff.nixl)"
        " || !has(self.kvHandoff.nixl.blockSize)"
        f" || self.kvHandoff.nixl.blockSize % {CPU_BLOCK_MULTIPLE} == 0",
        NIXL_CPU_BLOCK_SIZE,
    ),
    cel(
        "!has(self.kvHandoff) || !has(self.kvHandoff.nixl)"
        " || !has(self.kvHandoff.nixl.rdma) || !has(self.kvHandoff.nixl.rdma.resources)"
        " || !(self.resources.gpuResourceName in self.kvHandoff.nixl.rdma.resources)",
        RDMA_NOT_GPU,
    ),
    cel(
        "self.replicasOwner != 'operator' || has(self.autoscaling)",
        OPERATOR_NEEDS_AUTOSCALING,
    ),
    cel("self.role == oldSelf.role", "role is immutable"),
    cel("self.service == oldSelf.service", "service is immutable"),
]
"""The ServingPool spec's ``x-kubernetes-validations``, in the order the CRD lists them (each a
:func:`~.common.cel` entry; typed as JSON values, the type of a schema's list)."""
