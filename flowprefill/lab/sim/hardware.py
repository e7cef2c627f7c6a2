"""Model shapes and GPU constants the simulated cost model is built from.

Every number here is a published specification, cited beside it; nothing is tuned to make
a result come out. Only Llama-3-8B on A100 has *measured* operator times (the vidur
profile); the other models and GPUs are derived from it by the scaling rules documented
in :mod:`flowprefill.lab.sim.cost` and docs/simulator.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowprefill.errors import UnknownNameError


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A dense decoder-only transformer (Llama-style: GQA attention, gated MLP)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    default_tp: int
    """Tensor-parallel degree the paper serves this model with (§6.1)."""
    max_context_tokens: int
    vocab_size: int = 0
    """Rows of the (untied) LM head a decode step reads; 0 where unknown (not counted)."""

    @property
    def qkv_weights(self) -> int:
        return self.hidden_size * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def o_weights(self) -> int:
        return self.num_heads * self.head_dim * self.hidden_size

    @property
    def gate_up_weights(self) -> int:
        return self.hidden_size * 2 * self.intermediate_size

    @property
    def down_weights(self) -> int:
        return self.intermediate_size * self.hidden_size

    def kv_bytes_per_token_per_layer(self, tp: int, dtype_bytes: int = 2) -> int:
        """K and V of one token in one layer on one GPU (bf16)."""
        return 2 * max(1, self.num_kv_heads // tp) * self.head_dim * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of one token in every layer, every KV head (what a hand-off moves per
        prompt token): ``2 × layers × kv_heads × head_dim × dtype_bytes``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def decode_weight_params(self) -> int:
        """Parameters one decode step reads: every layer's projections and the LM head
        (the embedding lookup reads one row; norms are negligible)."""
        per_layer = self.qkv_weights + self.o_weights + self.gate_up_weights + self.down_weights
        return self.num_layers * per_layer + self.vocab_size * self.hidden_size


# Shapes from each model's config.json on the Hugging Face Hub.
MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        # meta-llama/Meta-Llama-3-8B (the vidur profile's model). Context: 8K natively; the
        # paper serves QwenTrace prompts up to ~32K, so we allow the profile's 32K range.
        # KV: 2 × 32 × 8 × 128 × 2 B = 128 KiB per token.
        ModelShape("llama3-8b", 32, 4096, 32, 8, 128, 14336, 1, 32768, 128256),
        # Qwen/Qwen2.5-14B-Instruct, served with TP=2 in the paper.
        ModelShape("qwen2.5-14b", 48, 5120, 40, 8, 128, 13824, 2, 32768, 152064),
        # meta-llama/Meta-Llama-3-70B config.json: 80 layers, hidden 8192, 64 heads, 8 KV
        # heads (head_dim 8192/64 = 128), intermediate 28672, vocab 128256, 8K context
        # natively (the profile's 32K range allowed, as for 8B). TP=4: the paper's degree
        # (§6.1), and the usual one — 140 GB of bf16 weights fit no single 80 GB GPU, and
        # four leave ~45 GB each for KV. KV: 2 × 80 × 8 × 128 × 2 B = 320 KiB per token.
        ModelShape("llama3-70b", 80, 8192, 64, 8, 128, 28672, 4, 32768, 128256),
    )
}

REFERENCE_MODEL = "llama3-8b"
"""The model whose operator times were measured (vidur); others scale from it."""


@dataclass(frozen=True, slots=True)
class GPUSpec:
    name: str
    peak_bf16_flops: float
    """Dense BF16 tensor-core peak, FLOP/s."""
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    """Per-GPU one-direction NVLink bandwidth used for tensor-parallel all-reduce."""
    source: str


GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec(
            "a100",
            312e12,
            2.039e12,
            300e9,
            "NVIDIA A100 datasheet (SXM4-80GB): 312 TFLOP/s BF16 dense, 2,039 GB/s HBM2e, "
            "600 GB/s NVLink (300 GB/s per direction)",
        ),
        GPUSpec(
            "a800",
            312e12,
            2.039e12,
            200e9,
            "A800-SXM4-80GB = A100 compute and memory with NVLink cut to 400 GB/s; the "
            "paper's testbed (§6.1, '200 GB/s NVLink')",
        ),
        GPUSpec(
            "h100",
            989e12,
            3.35e12,
            450e9,
            "NVIDIA H100 SXM5 datasheet: 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3, 900 GB/s "
            "NVLink (450 GB/s per direction)",
        ),
    )
}

REFERENCE_GPU = "a100"
"""The GPU the vidur operator times were measured on."""


def get_model(name: str) -> ModelShape:
    model = MODELS.get(name.lower())
    if model is None:
        raise UnknownNameError("model", name, sorted(MODELS))
    return model


def get_gpu(name: str) -> GPUSpec:
    gpu = GPUS.get(name.lower())
    if gpu is None:
        raise UnknownNameError("GPU", name, sorted(GPUS))
    return gpu
