"""Pure: what a pool's pods run — the engine's ``engine.json``, the prefill and vLLM
processes (:class:`~flowprefill.contracts.processes.ProcessSpec`) and a colocated pod's
launch spec — from its ServingPool spec. The Kubernetes objects around them:
:mod:`.pool`."""

from __future__ import annotations

import dataclasses

from flowprefill.contracts import EngineConfig, KVHandoffSettings, KVTransport
from flowprefill.contracts.deployment import (
    COLOCATED_BEAT_SOCKET,
    COLOCATED_HEALTH_PORT,
    DECODE_PORT,
    DECODE_SIDE_CHANNEL_PORT,
    ENGINE_CONFIG_PATH,
    POD_IP_ENV,
    PREFILL_PORT,
    PROFILE_DIR,
)
from flowprefill.contracts.engine import DecodeAwareSettings
from flowprefill.contracts.prefill_api import COLOCATED_DECODE_URL_FLAG
from flowprefill.contracts.processes import (
    Launcher,
    ProcessSpec,
    decode_process,
    prefill_process,
)

from ..colocated import Child, LaunchSpec
from ..models import ServingPoolSpec
from ..models.kvhandoff import DEFAULT_BUDGET, KVHandoff
from . import nixl, rollout
from .model import model_dir

IMAGE = Launcher.image()


def build_engine_config(spec: ServingPoolSpec) -> EngineConfig:
    engine = spec.engine_settings
    profile = engine.ttft_profile
    return EngineConfig(
        model_path=model_dir(spec.model),
        granularity=engine.granularity,
        batch_token_budget=engine.batch_token_budget,
        chunk_size=engine.chunk_size,
        max_blocking_ms=engine.max_blocking_ms if engine.operator_splitting else "off",
        parked_memory_bytes=None
        if engine.parked_memory is None
        else int(quantity_value(engine.parked_memory)),
        policy=engine.policy,
        batching=engine.batching,
        predictor_path=f"{PROFILE_DIR}/{profile.key}" if profile else None,
        tp_size=engine.tp_size,
        device=engine.device,
        dtype=engine.dtype,
        num_threads=threads_per_rank(spec),
        kv=kv_settings(spec),
        decode_aware=decode_aware_settings(spec),
    )


def decode_aware_settings(spec: ServingPoolSpec) -> DecodeAwareSettings | None:
    """engine.json ``decode_aware`` of a colocated pod with ``colocated.decodeAware``:
    listen for its own vLLM's beats (:data:`COLOCATED_BEAT_SOCKET`)."""
    aware = spec.colocated_settings.decode_aware if spec.role == "colocated" else None
    if aware is None:
        return None
    return DecodeAwareSettings(
        socket_path=COLOCATED_BEAT_SOCKET, tbt_target_s=aware.tbt_target_seconds, rule=aware.rule
    )


def kv_settings(spec: ServingPoolSpec) -> KVHandoffSettings | None:
    """engine.json ``kv``: the pool's hand-off in effect (:attr:`ServingPoolSpec.kv`);
    with nixl no directory, and ``kv.nixl`` from :func:`.nixl.producer_settings`."""
    kv = spec.kv
    if kv is None:
        return None
    transport = KVTransport.parse(str(kv.transport))
    if transport is KVTransport.NIXL:
        return KVHandoffSettings(
            transport=transport, nixl=nixl.producer_settings(spec), max_age_s=kv.max_age_seconds
        )
    return KVHandoffSettings(
        transport=transport,
        dir=kv.mount_path,
        max_age_s=kv.max_age_seconds,
        budget_mb=kv_budget_bytes(kv) / 2**20,
    )


def kv_budget_bytes(kv: KVHandoff) -> int:
    """The hand-off files a prefill pod may hold (http, sharedDir): ``budget``, else 90 %
    of an explicit ``sizeLimit`` (room for files being written), else the default."""
    if kv.budget is not None:
        return int(quantity_value(kv.budget))
    if kv.size_limit is not None:
        return int(0.9 * quantity_value(kv.size_limit))
    return int(quantity_value(DEFAULT_BUDGET))


def kv_volume_size(kv: KVHandoff) -> str:
    """sizeLimit of an ``http`` pod's hand-off emptyDir, and the ephemeral storage it
    requests: an explicit ``sizeLimit``, else the budget plus a tenth (at least 256 MiB),
    so that prefill refuses a hand-off (decode recomputes) before the kubelet would evict
    the pod for its disk use."""
    if kv.size_limit is not None:
        return kv.size_limit
    budget = kv_budget_bytes(kv)
    return f"{-(-(budget + max(budget // 10, 256 * 2**20)) // 2**20)}Mi"


_SUFFIXES = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}  # fmt: skip


def quantity_value(quantity: str) -> float:
    """A Kubernetes quantity as the CRD's pattern admits it (``"8"``, ``"500m"``, ``"4Gi"``)."""
    number = quantity.rstrip("mkMGTi")
    return float(number) * _SUFFIXES.get(quantity[len(number) :], 1.0)


def threads_per_rank(spec: ServingPoolSpec) -> int | None:
    """torch threads of each engine rank on a CPU pool with a CPU limit: the pod's cores
    shared by its ranks (torch's default counts the node's cores, not the pod's limit, so
    N ranks would each start one thread per node core). GPU pools and pods without a CPU
    limit keep the engine's default."""
    cpu = spec.resources.cpu
    if spec.engine_settings.device != "cpu" or cpu is None:
        return None
    return max(1, int(quantity_value(cpu)) // spec.engine_settings.tp_size)


SHM_PER_RANK_GI = 1
"""/dev/shm per tensor-parallel rank when the pool sets none: NCCL's shared-memory
transport and proxy, vLLM's shared-memory broadcast queue, torch tensors passed between
processes (vLLM's Kubernetes guide mounts 2Gi for its multi-GPU example)."""


def shm_size_limit(spec: ServingPoolSpec) -> str | None:
    """sizeLimit of the pod's memory-backed /dev/shm: ``resources.shmSize``, else 1Gi per
    rank with tensor parallelism, else none (the memory-backed volume without a limit: one
    process needs little)."""
    if spec.resources.shm_size is not None:
        return spec.resources.shm_size
    tp = spec.tensor_parallel_size
    if tp <= 1:
        return None
    # A colocated pod runs both instances' ranks.
    ranks = spec.prefill_tp_size + spec.decode_tp_size if spec.role == "colocated" else tp
    return f"{ranks * SHM_PER_RANK_GI}Gi"


def pool_process(spec: ServingPoolSpec) -> ProcessSpec:
    """The pool's container process, from the description ``flowprefill up`` renders too,
    with the drain bound of :func:`.rollout.drain_args`. With nixl, decode also gets
    ``--block-size`` (prefill's engine.json has the same) and its side-channel port; its
    ``--model`` is the string prefill's ``served_model`` is. A colocated pod runs both
    (:func:`colocated_launch`); this is its prefill process."""
    return decode_pool_process(spec) if spec.role == "decode" else prefill_pool_process(spec)


def _transport(spec: ServingPoolSpec) -> KVTransport | None:
    kv = spec.kv
    return KVTransport.parse(str(kv.transport)) if kv else None


def prefill_pool_process(spec: ServingPoolSpec) -> ProcessSpec:
    """``serve-prefill`` of a prefill or colocated pod (:func:`pool_process`)."""
    process = prefill_process(
        IMAGE,
        engine_config_path=ENGINE_CONFIG_PATH,
        port=PREFILL_PORT,
        kv_transport=_transport(spec),
        advertise_host=f"$({POD_IP_ENV})",
    )
    # The server's drain bound, which the pod's grace period is sized around.
    return dataclasses.replace(process, args=(*process.args, *rollout.drain_args(spec, "prefill")))


def decode_pool_process(spec: ServingPoolSpec) -> ProcessSpec:
    """vLLM of a decode or colocated pod (:func:`pool_process`); in a colocated pod on GPUs
    with ``--gpu-memory-utilization`` of ``colocated.decodeMemoryFraction``."""
    transport = _transport(spec)
    is_nixl = transport is KVTransport.NIXL
    memory = (
        ["--gpu-memory-utilization", f"{spec.colocated_settings.decode_memory_fraction:g}"]
        if spec.role == "colocated" and spec.on_gpu
        else []
    )
    return decode_process(
        IMAGE,
        model_path=model_dir(spec.model),
        port=DECODE_PORT,
        kv_transport=transport,
        kv_path=decode_kv_path(spec),
        cpu=spec.resources.gpus_per_pod == 0,
        tensor_parallel_size=spec.vllm_settings.tensor_parallel_size,
        extra_args=[
            *nixl.decode_block_size_args(spec),
            *memory,
            # vLLM's default (0) aborts every stream on SIGTERM.
            *rollout.drain_args(spec, "decode"),
            *spec.vllm_args,
        ],
        side_channel_port=DECODE_SIDE_CHANNEL_PORT if is_nixl else None,
        # Decode-aware preemption: vLLM's steps beat to the engine beside it.
        beat_sockets=(COLOCATED_BEAT_SOCKET,) if decode_aware_settings(spec) else (),
    )


def colocated_launch(spec: ServingPoolSpec) -> LaunchSpec:
    """What a colocated pod's launcher runs (:mod:`..colocated`): prefill capped at
    ``colocated.prefillMemoryFraction`` of its GPU (no cap without GPUs), then vLLM;
    each with its own environment (decode's NIXL side-channel port must not reach
    prefill). Prefill names its pod's own decode in every answer
    (``--colocated-decode-url http://$(POD_IP):8200``: the pod's address, which the gateway
    reaches, not loopback), so the gateway decodes each request in the pod that prefilled
    it. Stopping the survivor of a crash waits the pod's drain bound."""
    prefill, decode = prefill_pool_process(spec), decode_pool_process(spec)
    prefill = dataclasses.replace(
        prefill,
        args=(*prefill.args, COLOCATED_DECODE_URL_FLAG, f"http://$({POD_IP_ENV}):{decode.port}"),
    )
    return LaunchSpec(
        prefill=Child(
            name="prefill",
            argv=prefill.argv,
            port=prefill.port,
            ready_path=prefill.ready_path,
            health_path=prefill.health_path,
            env=dict(prefill.env),
            memory_fraction=spec.colocated_settings.prefill_memory_fraction
            if spec.on_gpu
            else None,
        ),
        decode=Child(
            name="decode",
            argv=decode.argv,
            port=decode.port,
            ready_path=decode.ready_path,
            health_path=decode.health_path,
            env=dict(decode.env),
        ),
        health_port=COLOCATED_HEALTH_PORT,
        stop_timeout_s=float(rollout.pool_drain_s(spec)),
    )


def decode_kv_path(spec: ServingPoolSpec) -> str | None:
    """Decode's hand-off directory: the shared claim's mount (sharedDir), its cache of
    pulled hand-offs (http: in a colocated pod ``<mountPath>-pulled``, beside prefill's
    ``mountPath``), none with nixl or without a hand-off."""
    kv = spec.kv
    if kv is None or kv.transport == "nixl":
        return None
    if kv.transport == "http" and spec.role == "colocated":
        return pulled_path(kv.mount_path)
    return kv.mount_path


def pulled_path(mount_path: str) -> str:
    """A colocated pod's directory of pulled hand-offs, beside prefill's ``mount_path``."""
    return f"{mount_path.rstrip('/')}-pulled"
