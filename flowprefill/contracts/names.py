"""Every name a user or another process may write, as an enum with one parser.

Configs, CLI flags, CRDs and the simulator all accept these names, and every one of them
goes through :meth:`Name.parse`: case-insensitive, surrounding blanks ignored, ``_`` and
``-`` interchangeable or left out (``S_EDF`` is ``s-edf``; ``shared-dir`` and the CRDs'
``sharedDir`` are ``shared_dir``). An
unknown name raises :class:`~flowprefill.errors.UnknownNameError` listing the valid ones.
The canonical spelling (the enum's value) is what files and manifests carry.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Self

from pydantic import BeforeValidator

from flowprefill.errors import UnknownNameError


def _key(value: str) -> str:
    # "S_EDF", "s-edf"; "shared_dir", "shared-dir", and the CRDs' camelCase "sharedDir".
    return value.strip().lower().replace("_", "").replace("-", "")


class Name(StrEnum):
    """Base of the name enums; ``describe()`` says what kind of name it is in errors."""

    @classmethod
    def describe(cls) -> str:
        return _WHAT.get(cls, cls.__name__)

    @classmethod
    def parse(cls, value: object) -> Self:
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            wanted = _key(value)
            for member in cls:
                if _key(member.value) == wanted:
                    return member
        raise UnknownNameError(cls.describe(), str(value), [m.value for m in cls])

    @classmethod
    def values(cls) -> list[str]:
        return [m.value for m in cls]


class Policy(Name):
    """Priority policy of the prefill scheduler (paper §4.3, §6.3)."""

    S_EDF = "s-edf"
    D_EDF = "d-edf"
    EDF = "edf"
    FCFS = "fcfs"


class Batching(Name):
    """How the engine's scheduler grows a batch around its leader (docs/simulator.md). The
    simulator's ablations add batchings of their own (:mod:`flowprefill.lab.sim.batching`)."""

    SLO_AWARE = "slo-aware"
    NONE = "none"
    MEMBER_HEADROOM = "member-headroom"


class Granularity(Name):
    """Where a running prefill can be preempted."""

    OPERATOR = "operator"
    LAYER = "layer"
    NONE = "none"


class Router(Name):
    """How a gateway (or the simulator's gateway) picks a prefill or decode instance."""

    SLACK_AWARE = "slack-aware"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"


class Admission(Name):
    """What the simulator's gateway does with a request at arrival."""

    NONE = "none"
    SHED_INFEASIBLE = "shed-infeasible"
    SHED_QUEUE = "shed-queue"


class KVTransport(Name):
    """Where KV hand-offs live between prefill and decode (docs/kv.md)."""

    SHARED_DIR = "shared_dir"
    HTTP = "http"
    NIXL = "nixl"
    """Stock vLLM decode pulls the KV from prefill's registered memory over NIXL
    (:mod:`flowprefill.contracts.nixl`)."""


class Kernels(Name):
    """Executor kernels: oneDNN linears on prepacked CPU weights, or the model's modules."""

    FAST = "fast"
    REFERENCE = "reference"


class DeviceSync(Name):
    """When a running prefill waits for its CUDA stream (flowprefill/prefill/executor/device.py):
    at every checkpoint, for the operator ``run_ahead`` checkpoints back, or only when parking."""

    EVERY_CHECK = "every_check"
    RUN_AHEAD = "run_ahead"
    ON_PREEMPT = "on_preempt"


class DType(Name):
    """Element type of weights, activations and KV caches. The value is torch's name for
    it, so the torch side derives its dtype from the name (:data:`flowprefill.kv.format.DTYPES`)."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]


_ITEMSIZE = {DType.BFLOAT16: 2, DType.FLOAT16: 2, DType.FLOAT32: 4}


class Role(Name):
    """The processes of a deployment."""

    PREFILL = "prefill"
    DECODE = "decode"
    GATEWAY = "gateway"


class RankCommand(Name):
    """What a tensor-parallel leader sends its follower ranks (flowprefill/prefill/tp/ranks.py):
    ``(command, *args)`` tuples over one pipe per follower."""

    SUBMIT = "submit"  # (key, slot, prompts)
    RESUME = "resume"  # (key,)
    CANCEL = "cancel"  # (key,)
    REPORT = "report"  # () → {key: checkpoints where the task parked}
    PUBLISH_KV = "publish_kv"  # (prompt digest, block ids) → ("ok", "") | ("error", why)
    STOP = "stop"  # ()


_WHAT: dict[type[Name], str] = {
    Policy: "scheduling policy",
    Batching: "batching policy",
    Granularity: "preemption granularity",
    Router: "routing policy",
    RankCommand: "tensor-parallel rank command",
    Admission: "admission policy",
    KVTransport: "KV transport",
    Kernels: "executor kernels",
    DeviceSync: "device sync mode",
    DType: "dtype",
    Role: "role",
}


# Pydantic field types: parse leniently with ``Name.parse``, store the enum member.
PolicyName = Annotated[Policy, BeforeValidator(Policy.parse)]
BatchingName = Annotated[Batching, BeforeValidator(Batching.parse)]
GranularityName = Annotated[Granularity, BeforeValidator(Granularity.parse)]
RouterName = Annotated[Router, BeforeValidator(Router.parse)]
KVTransportName = Annotated[KVTransport, BeforeValidator(KVTransport.parse)]
KernelsName = Annotated[Kernels, BeforeValidator(Kernels.parse)]
DeviceSyncName = Annotated[DeviceSync, BeforeValidator(DeviceSync.parse)]
DTypeName = Annotated[DType, BeforeValidator(DType.parse)]
