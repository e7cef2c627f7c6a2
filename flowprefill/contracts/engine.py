"""Settings of one prefill instance: ``engine.json``, read by ``flowprefill serve-prefill``.

The operator writes it into a ConfigMap, ``flowprefill up`` into its run folder; the
server's command-line flags only override fields of it. A config the engine cannot run
is refused here, when the model is validated, so the operator refuses it before any pod
starts.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    ValidationError,
    field_validator,
)

from flowprefill.contracts.beats import MAX_SOCKET_PATH_BYTES
from flowprefill.contracts.deployment import KERNELS_ENV, default_kv_dir, env_or
from flowprefill.contracts.names import (
    Batching,
    BatchingName,
    DeviceSync,
    DeviceSyncName,
    DType,
    DTypeName,
    Granularity,
    GranularityName,
    Kernels,
    KernelsName,
    KVTransport,
    KVTransportName,
    Policy,
    PolicyName,
)
from flowprefill.contracts.nixl import (
    DEFAULT_LEASE_S,
    DEFAULT_SIDE_CHANNEL_PORT,
    SIDE_CHANNEL_HOST_ENV,
)
from flowprefill.contracts.slo import PAPER_TBT_SLOS_S
from flowprefill.errors import InvalidRequestError

MAX_TP_SIZE = 8
"""Largest tensor-parallel degree the engine serves: the ranks of one instance run as
processes on one machine (one pod), and no common machine has more than 8 GPUs on one
NVLink domain. Whether a model splits ``tp_size`` ways (attention and KV heads divisible
by it) is checked when the engine loads the model (docs/executor.md)."""


DEFAULT_BATCH_TOKEN_BUDGET = 4096
"""Default bound on the prompt tokens of one batched prefill: the paper's setting, and the
budget of the simulator's FlowPrefill system (docs/simulator.md)."""


DEFAULT_MAX_BLOCKING_MS = 4.0
"""The paper's bound on a stretch between two preemption checkpoints on a GPU: an operator
predicted to run longer is split at run time (attention in blocks of query rows, linears in
tiles of token rows) so an urgent arrival waits at most about this long (docs/executor.md,
"Bounded blocking"). The paper reports operator-level blocking of mean 2.6 ms, max < 4.5 ms
on A100; the simulated A100 stays under 4.5 ms with this bound
(``python benchmarks/sim/bounded_blocking.py``, docs/simulator.md), and the simulator's GPU
uses it by default. The engine does not split on a GPU unless ``max_blocking_ms`` is set:
on an H100, splitting at this bound made a 32K-token prefill of Llama-3-8B 54 % slower and
an urgent prompt's TTFT behind it later, not sooner (docs/gpu.md)."""

DEFAULT_MAX_BLOCKING_MS_CPU = 100.0
"""The CPU default. A CPU runs the same operator about 100x slower than a GPU, and its flash
attention kernel loses efficiency on blocks of few query rows, so a tighter bound costs
prefill time. On one 8,192-token demo-llama prompt with 1 thread, max blocking falls from
936 ms unsplit to 117 ms at this bound for +3.0 % prefill time, and to 205 ms at 200 ms for
+1.1 % (``python benchmarks/prefill/bounded_blocking.py --threads 1 --repeats 5 --bounds
200 100 50`` on a quiet machine; docs/executor.md). It stays at 100 ms because the bound
must sit well under the tightest SLO ``flowprefill up`` derives from the machine's profile."""

OFF: Literal["off"] = "off"


def max_blocking_arg(text: str) -> float | Literal["off"]:
    """``--max-blocking-ms`` on the command line: a positive number of ms, or ``off``."""
    if text.strip().lower() == OFF:
        return OFF
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(
            f"--max-blocking-ms must be a positive number of milliseconds or 'off', got {text!r}"
        )
    return value


class NixlSettings(BaseModel):
    """The prefill instance as a NIXL producer for stock vLLM decode (docs/kv.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    side_channel_port: int = Field(
        DEFAULT_SIDE_CHANNEL_PORT, ge=0, lt=65536, description="Handshake port (0: any free one)."
    )
    advertise_host: str | None = Field(
        None,
        description="Address decode reaches the side channel and agent at (null: "
        f"${SIDE_CHANNEL_HOST_ENV}, else the listen address; in a pod, the pod IP).",
    )
    served_model: str | None = Field(
        None,
        description="Decode's --model argument exactly (the handshake's compatibility hash "
        "embeds it); null: model_path.",
    )
    buffer_mb: float = Field(
        512.0, gt=0, description="Registered KV buffer (MiB) for prompts awaiting decode."
    )
    block_size: int | None = Field(
        None,
        ge=1,
        description="Tokens per block; must equal decode's --block-size (null: 128 "
        "on CPU, vLLM's GPU default 16 otherwise).",
    )
    attention_backend: str | None = Field(
        None, description="Decode's attention backend (null: CPU_ATTN on CPU, FLASH_ATTN on GPU)."
    )
    lease_s: float = Field(
        DEFAULT_LEASE_S, gt=0, description="Blocks no decode read are freed after this long."
    )
    progress_thread: bool | None = Field(
        None,
        description="Run NIXL's progress thread (it polls without sleeping: a core to "
        "itself); null: on a GPU yes, on CPU no (the notification poll progresses the agent).",
    )


DEFAULT_KV_BUDGET_MB = 8192.0
"""Hand-off files a prefill instance holds for decode by default: 8 GiB, about 64K tokens
of Llama-3-8B (128 KiB a token) — a few seconds of a GPU's prefill output if decode stalls."""


class KVHandoffSettings(BaseModel):
    """Where a prefill instance writes KV hand-offs for decode (docs/kv.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    transport: KVTransportName = Field(
        KVTransport.SHARED_DIR,
        description="shared_dir: decode reads `dir` (a shared volume); http: this instance "
        "serves hand-offs at /v1/kv/<id> on its KV port (serve-prefill --kv-port) and decode "
        "pulls them; nixl: stock vLLM decode (NixlConnector) pulls them from this instance's "
        "registered KV buffer.",
    )
    nixl: NixlSettings | None = Field(
        None, description="The NIXL producer's settings (nixl transport; null: defaults)."
    )
    dir: str | None = Field(
        None, description="Hand-off directory (null: $FLOWPREFILL_KV_DIR or /tmp/flowprefill-kv)."
    )
    advertise_url: str | None = Field(
        None,
        description="Base URL decode pulls from (http transport; null: "
        "$FLOWPREFILL_KV_ADVERTISE_URL, else derived from the listen address).",
    )
    max_age_s: float = Field(
        600.0, gt=0, description="Hand-offs no decode consumed are swept after this long."
    )
    budget_mb: float = Field(
        DEFAULT_KV_BUDGET_MB,
        gt=0,
        description="shared_dir and http: the most hand-off files the directory holds (MiB); "
        "a prompt that would go past it gets no hand-off and decode recomputes it. nixl: "
        "the budget is the registered buffer (nixl.buffer_mb).",
    )

    @property
    def resolved_dir(self) -> str:
        return self.dir or default_kv_dir()


DEFAULT_TBT_TARGET_S = min(PAPER_TBT_SLOS_S.values())
"""The TBT target decode-aware preemption protects by default: the tightest of the paper's
§6.5 classes (text and image, 0.1 s), which ``flowprefill bench`` also judges by."""


class DecodeAwareSettings(BaseModel):
    """Decode-aware preemption (docs/executor.md): decode sends step *beats* to
    ``socket_path`` (its beat connector, docs/kv.md) and a running prefill parks at the next
    operator boundary while a decode step whose TBT target is at risk runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    socket_path: str = Field(
        description="Unix datagram socket this instance listens on for decode's beats; "
        "decode's beat connector sends to the same path (same host, same pod)."
    )
    tbt_target_s: float = Field(
        DEFAULT_TBT_TARGET_S,
        gt=0,
        description="Time-between-tokens target of the tightest class decoding (s): a "
        "request's mean gap so far may not pass it.",
    )
    rule: Literal["gap", "mean"] = Field(
        "gap",
        description="gap: every time between tokens within the target (as `flowprefill "
        "bench` judges TBT); mean: each request's mean gap so far (the simulator's "
        "flowprefill-da rule; a request banks slack from quick steps).",
    )
    max_park_s: float | None = Field(
        None,
        gt=0,
        description="Longest single park (s; null: tbt_target_s): a lost beat or a hung "
        "decode never stalls prefill for longer.",
    )

    @field_validator("socket_path")
    @classmethod
    def _socket_path(cls, value: str) -> str:
        if not value or len(value.encode()) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(
                f"socket_path {value!r} must be a non-empty path of at most "
                f"{MAX_SOCKET_PATH_BYTES} bytes "
                "(a Unix socket address)"
            )
        return value


class EngineConfig(BaseModel):
    """``engine.json``. Names parse leniently (see :mod:`flowprefill.contracts.names`)."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(
        "tiny-llama",
        description="A local Hugging Face model directory, or a built-in tiny model name "
        "(tiny-llama, tiny-qwen2, tiny-qwen3-moe, demo-llama).",
    )
    granularity: GranularityName = Field(
        Granularity.OPERATOR, description="Where running prefills can be preempted."
    )
    chunk_size: int | None = Field(
        None,
        ge=16,
        description="Split prompts into chunks of this many tokens (None: no chunking).",
    )
    policy: PolicyName = Field(
        Policy.S_EDF, description=f"Priority policy: {', '.join(Policy.values())}."
    )
    batching: BatchingName = Field(
        Batching.SLO_AWARE, description=f"Batching policy: {', '.join(Batching.values())}."
    )
    batch_token_budget: int = Field(
        DEFAULT_BATCH_TOKEN_BUDGET, ge=1, description="Most tokens in one batched prefill."
    )
    predictor_path: str | None = Field(
        None,
        description="TTFT profile JSON written by `flowprefill profile`; profiled at start "
        "when absent.",
    )
    device: str = Field("cpu", description="torch device, e.g. cpu or cuda:0.")
    dtype: DTypeName = Field(DType.FLOAT32, description="Weights and activations dtype.")
    kernels: KernelsName | None = Field(
        None,
        description="Executor kernels: fast (oneDNN linears on prepacked float32 CPU weights) "
        f"or reference (the model's own modules); None: ${KERNELS_ENV}, else fast.",
    )
    device_sync: DeviceSyncName = Field(
        DeviceSync.EVERY_CHECK,
        description="When a running prefill waits for its CUDA stream (no effect on cpu): "
        "every_check, at every checkpoint (the lowest blocking); run_ahead, for the "
        "operator before the last, so launches overlap the GPU (cheaper for short prompts, "
        "about one operator more blocking: docs/gpu.md); on_preempt, only when parking.",
    )
    tp_size: int = Field(
        1,
        ge=1,
        description=f"Tensor-parallel degree: ranks (processes) of this instance, 1 to "
        f"{MAX_TP_SIZE}; the model's attention and KV heads must divide by it.",
    )
    max_blocking_ms: PositiveFloat | Literal["off"] | None = Field(
        None,
        description="Split operators predicted to run longer than this many milliseconds "
        f"between two preemption checkpoints; null: the device's default (no splitting on "
        f"cuda, measured slower on an H100 at the paper's {DEFAULT_MAX_BLOCKING_MS:g} ms; "
        f"{DEFAULT_MAX_BLOCKING_MS_CPU:g} on cpu); "
        '"off": never split. Operator granularity only.',
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (None: torch's default)."
    )
    parked_memory_bytes: int | None = Field(
        None,
        ge=0,
        description="Most bytes (activations and KV cache) preempted tasks may hold while "
        "parked; a preemption that would exceed it is declined and the urgent request waits "
        "(docs/executor.md). null: unbounded. Per process (each tensor-parallel rank).",
    )
    kv: KVHandoffSettings | None = Field(
        None, description="KV hand-off to decode; null: none (decode recomputes the prompt)."
    )
    decode_aware: DecodeAwareSettings | None = Field(
        None,
        description="Decode-aware preemption: park the running prefill for decode steps "
        "whose TBT target is at risk; null: off (decode and prefill share the device blindly).",
    )

    @field_validator("tp_size")
    @classmethod
    def _servable_tp(cls, value: int) -> int:
        if value > MAX_TP_SIZE:
            raise ValueError(
                f"tp_size={value}: the engine runs at most tp_size={MAX_TP_SIZE} ranks, all "
                "on one machine (docs/executor.md, tensor parallelism)"
            )
        return value

    def resolved_max_blocking_ms(self) -> float | None:
        """The bound the executor splits by, or None for no splitting."""
        if self.max_blocking_ms == OFF or self.granularity is not Granularity.OPERATOR:
            return None
        if self.max_blocking_ms is None:
            # On a GPU the split cost more than it saved (DEFAULT_MAX_BLOCKING_MS).
            cpu = self.device.split(":")[0] == "cpu"
            return DEFAULT_MAX_BLOCKING_MS_CPU if cpu else None
        return float(self.max_blocking_ms)

    def resolved_kernels(self) -> Kernels:
        """``kernels``, else ``$FLOWPREFILL_KERNELS``, else fast (read here, once)."""
        if self.kernels is not None:
            return self.kernels
        return Kernels.parse(env_or(KERNELS_ENV, Kernels.FAST.value))

    @classmethod
    def load(cls, path: str | Path) -> EngineConfig:
        p = Path(path)
        try:
            return cls.model_validate_json(p.read_text())
        except FileNotFoundError:
            raise InvalidRequestError(f"engine config {p} does not exist") from None
        except ValidationError as e:
            raise InvalidRequestError(f"engine config {p}: {e}") from None
