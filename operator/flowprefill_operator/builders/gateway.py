"""Pure: the pools of one service -> the service's gateway (Deployment, Service, ConfigMaps)."""

from __future__ import annotations

from typing import Any

from flowprefill.contracts import Endpoint, GatewayConfig, SLOTable
from flowprefill.contracts.deployment import (
    DECODE_PORT,
    GATEWAY_CONFIG_PATH,
    GATEWAY_PORT,
    PREFILL_PORT,
    SLO_DIR,
    SLO_TABLE_FILE,
)
from flowprefill.contracts.processes import ProcessSpec, gateway_process

from ..models.gateway import GATEWAY_SUFFIX, pool_workload_name
from ..settings import OperatorSettings
from . import rollout
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
    gateway_selector,
    http_probes,
    metadata,
    owner_reference,
    pod_security_context,
)
from .gateway_ha import (
    anti_affinity,
    build_hpa,
    build_http_route,
    build_pdb,
    gateway_replicas,
    gateway_strategy,
)
from .model import tokenizer_dir, tokenizer_parts
from .overlay import apply_pod_overlay
from .processes import IMAGE


def gateway_name(service: str) -> str:
    """The gateway's Deployment, Service, ConfigMap, PDB, HPA and HTTPRoute. Unique: no
    other service's gateway ends in the same name, and no pool may end its name in
    :data:`GATEWAY_SUFFIX` (:func:`pool_workload_name` escapes it in pools' children)."""
    return f"{service}{GATEWAY_SUFFIX}"


def slo_table_name(service: str) -> str:
    return f"{service}-slo-table"


def gateway_url(service: str, namespace: str, settings: OperatorSettings) -> str:
    return (
        f"http://{gateway_name(service)}.{namespace}.svc.{settings.cluster_domain}:{GATEWAY_PORT}"
    )


def gateway_command() -> ProcessSpec:
    return gateway_process(
        IMAGE,
        gateway_config_path=GATEWAY_CONFIG_PATH,
        slo_table_path=f"{SLO_DIR}/{SLO_TABLE_FILE}",
        port=GATEWAY_PORT,
        drain_timeout_s=rollout.GATEWAY_DRAIN_S,
    )


def build_gateway_config(pools: list[PoolRef], settings: OperatorSettings) -> GatewayConfig:
    first = pools[0]

    def endpoint(pool: PoolRef, port: int) -> Endpoint:
        host = f"{pool_workload_name(pool.name)}.{pool.namespace}.svc.{settings.cluster_domain}"
        return Endpoint.at(pool.name, host, port)

    ordered = sorted(pools, key=lambda p: p.name)
    return GatewayConfig(
        service=first.spec.service,
        # The gateway tokenizes prompts with the model's own tokenizer (its files alone).
        tokenizer_path=tokenizer_dir(tokenizer_pool(pools).spec.model),
        model_name=next((p.spec.model.name for p in ordered if p.spec.model.name), None)
        or first.spec.service,
        # A colocated pool is in both lists, on its two ports (one Service, one name).
        prefill=[endpoint(p, PREFILL_PORT) for p in ordered if p.spec.runs_prefill],
        decode=[endpoint(p, DECODE_PORT) for p in ordered if p.spec.runs_decode],
    )


def tokenizer_pool(pools: list[PoolRef]) -> PoolRef:
    """The pool whose model source gives the gateway its tokenizer (a prefill or colocated
    pool)."""
    ordered = sorted(pools, key=lambda p: p.name)
    return next((p for p in ordered if p.spec.runs_prefill), ordered[0])


def _owners(pools: list[PoolRef]) -> list[dict[str, Any]]:
    # Owned by every pool of the service: garbage-collected after the last one goes.
    return [owner_reference(p, controller=False) for p in sorted(pools, key=lambda p: p.name)]


def build_slo_table_configmap(pools: list[PoolRef], table: SLOTable) -> Manifest:
    service, namespace = pools[0].spec.service, pools[0].namespace
    meta = metadata(
        slo_table_name(service), namespace, component_labels(service, "gateway"), _owners(pools)
    )
    return configmap(meta, {SLO_TABLE_FILE: dumps(table.model_dump())})


def build_gateway_children(
    pools: list[PoolRef], table: SLOTable, settings: OperatorSettings, *, overlay: bool = True
) -> list[Manifest]:
    """ConfigMaps, Deployment and Service of one service's gateway (``pools`` non-empty),
    and per the tokenizer pool's ``gateway`` (:mod:`.gateway_ha`) a PodDisruptionBudget
    (more than one pod), a HorizontalPodAutoscaler and an HTTPRoute.

    The pod gets the operator-wide pull secrets and the ``gatewayPod`` overlay of the
    pool the tokenizer comes from (``overlay=False``: without it); raises
    :class:`OverlayConflict` when that overlay reuses one of the pod's volume names or
    mount paths."""
    service, namespace = pools[0].spec.service, pools[0].namespace
    labels = component_labels(service, "gateway")
    owners = _owners(pools)
    name = gateway_name(service)
    config = configmap(
        metadata(name, namespace, labels, owners),
        {"gateway.json": dumps(build_gateway_config(pools, settings).model_dump())},
    )
    volumes = [
        {"name": "config", "configMap": {"name": name}},
        {"name": "slo", "configMap": {"name": slo_table_name(service)}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts = [
        {"name": "config", "mountPath": GATEWAY_CONFIG_PATH, "subPath": "gateway.json",
         "readOnly": True},
        # A directory mount (not subPath) so the kubelet refreshes the table in place.
        {"name": "slo", "mountPath": SLO_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]  # fmt: skip
    tokenizer = tokenizer_parts(tokenizer_pool(pools).spec.model, settings.gateway_image, settings)
    volumes += tokenizer.volumes
    mounts += tokenizer.mounts
    process = gateway_command()
    container = {
        "name": "gateway",
        "image": settings.gateway_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": process.argv,
        "ports": [{"name": "http", "containerPort": process.port, "protocol": "TCP"}],
        "env": list(SCRATCH_ENV),
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
        **http_probes("http", process, startup_s=60),
    }
    lifecycle, grace_s = rollout.termination(rollout.GATEWAY_DRAIN_S)
    container["lifecycle"] = lifecycle
    ha = tokenizer_pool(pools).spec.gateway
    pod_spec = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "affinity": anti_affinity(gateway_selector(service)),
        "terminationGracePeriodSeconds": grace_s,
        "containers": [container],
        "volumes": volumes,
        **({"initContainers": tokenizer.init_containers} if tokenizer.init_containers else {}),
    }
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": gateway_selector(service)},
        "strategy": gateway_strategy(),
        "progressDeadlineSeconds": rollout.progress_deadline_s(
            pod_spec, downloads=bool(tokenizer.init_containers)
        ),
    }
    if ha is None or ha.autoscaling is None:
        # With an HPA the count is the HPA's: rendered without one, the gateway
        # controller fills in the live count (controllers/gateway.py: with_hpa_replicas).
        deployment_spec["replicas"] = gateway_replicas(ha, settings)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name, namespace, labels, owners),
        "spec": {
            **deployment_spec,
            "template": apply_pod_overlay(
                {
                    "metadata": {
                        "labels": labels,
                        # The SLO table is hot-reloaded; only gateway.json changes roll pods.
                        "annotations": {CONFIG_HASH: config_hash(config["data"])},
                    },
                    "spec": pod_spec,
                },
                tokenizer_pool(pools).spec.gateway_pod if overlay else None,
                pull_secrets=settings.child_image_pull_secrets,
            ),
        },
    }
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(name, namespace, labels, owners),
        "spec": {
            "type": "ClusterIP",
            "selector": gateway_selector(service),
            "ports": [
                {"name": "http", "port": GATEWAY_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
    extras = [
        build_pdb(metadata(name, namespace, labels, owners), gateway_selector(service), ha,
                  settings),
        build_hpa(metadata(name, namespace, labels, owners), name, ha),
        build_http_route(metadata(name, namespace, labels, owners), name, ha, settings),
    ]  # fmt: skip
    return [config, build_slo_table_configmap(pools, table), deployment, svc] + [
        m for m in extras if m is not None
    ]
