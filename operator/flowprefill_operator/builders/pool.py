"""Pure: one ServingPool -> its Deployment, headless Service and (prefill, colocated) engine
ConfigMap."""

from __future__ import annotations

from typing import Any

from flowprefill.contracts.deployment import (
    DECODE_PORT,
    ENGINE_CONFIG_PATH,
    POD_IP_ENV,
    PREFILL_PORT,
    PROFILE_DIR,
)
from flowprefill.contracts.processes import (
    ProcessSpec,
)

from ..colocated import LAUNCHER_MODULE
from ..models import ServingPoolSpec
from ..models.gateway import pool_workload_name
from ..settings import OperatorSettings
from . import nixl, rollout
from .common import (
    CONFIG_HASH,
    SCRATCH_ENV,
    Manifest,
    PoolRef,
    component_labels,
    config_hash,
    configmap,
    container_security_context,
    dumps,
    http_probes,
    metadata,
    owner_reference,
    pod_security_context,
    pool_selector,
    probes_at,
    scratch_volumes,
)
from .model import model_parts
from .overlay import apply_pod_overlay
from .processes import (
    build_engine_config,
    colocated_launch,
    kv_volume_size,
    pool_process,
    prefill_pool_process,
    pulled_path,
    quantity_value,
    shm_size_limit,
)


def engine_configmap_name(pool_name: str) -> str:
    return f"{pool_name}-engine"


def pool_port(spec: ServingPoolSpec) -> int:
    """The pool's main port (``http``): prefill's, decode's; a colocated pod's prefill port
    (its decode port is :data:`DECODE_PORT`, named ``decode``)."""
    return DECODE_PORT if spec.role == "decode" else PREFILL_PORT


COLOCATED_STARTUP_S = 900 + 1800
"""A colocated pod's startup budget: prefill's load, then decode's (started after)."""
DECODE_PORT_NAME = "decode"
HEALTH_PORT_NAME = "health"


KV_PORT_NAME = "kv"


def container_ports(process: ProcessSpec, spec: ServingPoolSpec) -> list[dict[str, Any]]:
    """``http`` (the API, probes, /metrics), and a prefill pod's ``kv`` port where decode
    pulls hand-offs (``http`` transport): a port of its own, which the chart's
    NetworkPolicy opens to decode pods alone. Not in the pool's Service: decode reaches
    the pod that wrote a hand-off by the address in the hand-off (``$(POD_IP)``). With
    nixl, the NIXL side channel (``nixl``, :func:`.nixl.container_ports`)."""
    ports = [{"name": "http", "containerPort": process.port, "protocol": "TCP"}]
    if process.kv_port is not None:
        ports.append({"name": KV_PORT_NAME, "containerPort": process.kv_port, "protocol": "TCP"})
    return ports + nixl.container_ports(spec)


def process_env(process: ProcessSpec) -> list[dict[str, Any]]:
    """The process's environment as container env; a prefill pod advertises its own IP
    (the Service name would land on any replica), so POD_IP comes first for $(POD_IP)."""
    env = pod_ip_env(process.env.values())
    env += [{"name": k, "value": v} for k, v in process.env.items()]
    return env


def pod_ip_env(texts: Any) -> list[dict[str, Any]]:
    """``POD_IP`` from the downward API when any of ``texts`` refers to ``$(POD_IP)`` (the
    kubelet expands it in env values, command and args alike)."""
    if any(f"$({POD_IP_ENV})" in v for v in texts):
        return [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    return []


def kv_volume(spec: ServingPoolSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The hand-off directory: the service's shared PVC, or (http) the pod's own emptyDir;
    none with nixl (the KV stays in prefill's registered memory) or without a hand-off."""
    kv = spec.kv
    if kv is None or kv.transport == "nixl":
        return [], []
    if kv.transport == "http":
        volume: dict[str, Any] = {"name": "kv", "emptyDir": {"sizeLimit": kv_volume_size(kv)}}
    else:
        volume = {"name": "kv", "persistentVolumeClaim": {"claimName": kv.claim_name}}
    volumes, mounts = [volume], [{"name": "kv", "mountPath": kv.mount_path}]
    if kv.transport == "http" and spec.role == "colocated":
        # Decode's cache of pulled hand-offs, apart from prefill's own: the same file
        # names (<id>.kv.safetensors) would otherwise land on each other, as `flowprefill
        # up` keeps them apart too.
        volumes.append({"name": PULLED_VOLUME, "emptyDir": {"sizeLimit": kv_volume_size(kv)}})
        mounts.append({"name": PULLED_VOLUME, "mountPath": pulled_path(kv.mount_path)})
    return volumes, mounts


PULLED_VOLUME = "kv-pulled"


def _resources(spec: ServingPoolSpec) -> dict[str, Any]:
    res = spec.resources
    amounts: dict[str, str] = {}
    if res.gpus_per_pod:
        amounts[res.gpu_resource_name] = str(res.gpus_per_pod)
    if res.cpu:
        amounts["cpu"] = res.cpu
    if res.memory:
        amounts["memory"] = res.memory
    amounts |= nixl.rdma_resources(spec)
    resources: dict[str, Any] = {"requests": dict(amounts), "limits": dict(amounts)}
    if spec.kv is not None and spec.kv.transport == "http":
        # The hand-off emptyDir lives on the node's disk: schedule where it fits. A request
        # only: the emptyDir's sizeLimit already bounds it, and the budget keeps it below.
        size = kv_volume_size(spec.kv)
        if spec.role == "colocated":  # prefill's hand-offs and decode's pulled copies
            size = f"{-(-2 * int(quantity_value(size)) // 2**20)}Mi"
        resources["requests"]["ephemeral-storage"] = size
    return resources if amounts or resources["requests"] else {}


def build_engine_configmap(pool: PoolRef) -> Manifest:
    labels = component_labels(pool.spec.service, pool.spec.role)
    meta = metadata(
        engine_configmap_name(pool.name),
        pool.namespace,
        labels,
        [owner_reference(pool, controller=True)],
    )
    return configmap(meta, {"engine.json": dumps(build_engine_config(pool.spec).model_dump())})


def build_deployment(
    pool: PoolRef, settings: OperatorSettings, config_digest: str, *, overlay: bool = True
) -> Manifest:
    """The pool's Deployment: its pod as the operator renders it, then the operator-wide
    pull secrets and the pool's ``pod`` overlay (``overlay=False``: without the latter).
    Raises :class:`OverlayConflict` when the overlay reuses one of the pod's volume names
    or mount paths."""
    spec = pool.spec
    labels = component_labels(spec.service, spec.role) | pool_selector(pool.name)
    # A colocated pod runs in the decode image: vLLM's base with FlowPrefill installed.
    image = spec.image or (
        settings.prefill_image if spec.role == "prefill" else settings.decode_image
    )
    volumes, mounts = scratch_volumes(shm_size_limit(spec))
    model = model_parts(spec.model, image, settings, labels)
    volumes += model.volumes
    mounts += model.mounts
    kv_volumes, kv_mounts = kv_volume(spec)
    volumes += kv_volumes
    mounts += kv_mounts
    if spec.runs_prefill:
        volumes.append({"name": "engine", "configMap": {"name": engine_configmap_name(pool.name)}})
        mounts.append(
            {"name": "engine", "mountPath": ENGINE_CONFIG_PATH, "subPath": "engine.json",
             "readOnly": True}
        )  # fmt: skip
        profile = spec.engine_settings.ttft_profile
        if profile:
            volumes.append({"name": "profile", "configMap": {"name": profile.name}})
            mounts.append({"name": "profile", "mountPath": PROFILE_DIR, "readOnly": True})
    container: dict[str, Any] = {
        "name": spec.role,
        "image": image,
        "imagePullPolicy": settings.image_pull_policy,
        "volumeMounts": mounts,
        "securityContext": container_security_context(add=nixl.capabilities_add(spec)),
    }
    if spec.role == "colocated":
        container |= colocated_container(spec)
    else:
        process = pool_process(spec)
        container |= {
            "command": process.argv,
            "ports": container_ports(process, spec),
            "env": [*SCRATCH_ENV, *process_env(process), *nixl.container_env(spec)],
            **http_probes("http", process, startup_s=900 if spec.role == "prefill" else 1800),
        }
    lifecycle, grace_s = rollout.pool_termination(spec)
    container["lifecycle"] = lifecycle
    if resources := _resources(spec):
        container["resources"] = resources
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": grace_s,
    }
    if model.init_containers:
        pod_spec["initContainers"] = model.init_containers
    if spec.resources.node_selector:
        pod_spec["nodeSelector"] = dict(spec.resources.node_selector)
    if spec.resources.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True)
                                   for t in spec.resources.tolerations]  # fmt: skip
    annotations = {CONFIG_HASH: config_digest} if config_digest else {}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(
            pool_workload_name(pool.name),
            pool.namespace,
            labels,
            [owner_reference(pool, controller=True)],
        ),
        "spec": {
            "replicas": spec.replicas,  # the pool's /scale is the one owner of this number
            "selector": {"matchLabels": pool_selector(pool.name)},
            "strategy": rollout.strategy(spec),
            "progressDeadlineSeconds": rollout.progress_deadline_s(
                pod_spec, downloads=bool(model.init_containers)
            ),
            "template": apply_pod_overlay(
                {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec},
                spec.pod if overlay else None,
                pull_secrets=settings.child_image_pull_secrets,
            ),
        },
    }


def colocated_container(spec: ServingPoolSpec) -> dict[str, Any]:
    """A colocated pod's command, ports, env and probes: the launcher with both processes
    (:func:`colocated_launch`); the probes ask the launcher, which answers for both. Each
    process's own env rides in the launch spec; the container's env is what both share."""
    launch = colocated_launch(spec)
    text = launch.to_json()
    prefill = prefill_pool_process(spec)
    ports = [
        *container_ports(prefill, spec)[:1],  # http: prefill's API
        {"name": DECODE_PORT_NAME, "containerPort": DECODE_PORT, "protocol": "TCP"},
        *container_ports(prefill, spec)[1:],  # kv (http transport), nixl, nixl-decode
        {"name": HEALTH_PORT_NAME, "containerPort": launch.health_port, "protocol": "TCP"},
    ]
    return {
        "command": ["python", "-m", LAUNCHER_MODULE, "run", text],
        "ports": ports,
        "env": [*SCRATCH_ENV, *pod_ip_env([text]), *nixl.container_env(spec)],
        **probes_at(HEALTH_PORT_NAME, "/health", "/ready", startup_s=COLOCATED_STARTUP_S),
    }


def build_pool_service(pool: PoolRef) -> Manifest:
    """Headless: the pool's DNS name resolves to every ready pod; the gateway picks one."""
    spec = pool.spec
    labels = component_labels(spec.service, spec.role) | pool_selector(pool.name)
    ports = [{"name": "http", "port": pool_port(spec), "targetPort": "http", "protocol": "TCP"}]
    if spec.role == "colocated":  # the gateway reaches its decode on the same name
        ports.append({"name": DECODE_PORT_NAME, "port": DECODE_PORT,
                      "targetPort": DECODE_PORT_NAME, "protocol": "TCP"})  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(
            pool_workload_name(pool.name),
            pool.namespace,
            labels,
            [owner_reference(pool, controller=True)],
        ),
        "spec": {
            "clusterIP": "None",
            "selector": pool_selector(pool.name),
            "ports": ports,
        },
    }


def build_pool_children(
    pool: PoolRef, settings: OperatorSettings, *, overlay: bool = True
) -> list[Manifest]:
    """Every object one pool owns, in apply order (config before the pods that read it).
    Raises :class:`OverlayConflict` as :func:`build_deployment` does."""
    children: list[Manifest] = []
    digest = ""
    if pool.spec.runs_prefill:
        cm = build_engine_configmap(pool)
        digest = config_hash(cm["data"])
        children.append(cm)
    children.append(build_deployment(pool, settings, digest, overlay=overlay))
    children.append(build_pool_service(pool))
    return children
