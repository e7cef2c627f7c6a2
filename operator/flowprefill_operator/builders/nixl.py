"""Pure: what the ``nixl`` KV transport adds to a pool's pod and to prefill's engine.json.

Prefill is a vLLM NIXL *producer* (``flowprefill.kv.nixl``); decode is stock vLLM with
``NixlConnector`` as ``kv_consumer``. The two meet through values each pool renders on its
own, so both come from here:

* the NIXL handshake hashes decode's ``--model`` string: prefill's ``served_model`` is
  :func:`~.model.model_dir` of its model, the very string decode's ``--model`` gets
  (the controller refuses two pools whose strings differ);
* the block size: prefill's ``block_size`` and decode's ``--block-size`` are both
  :attr:`~..models.ServingPoolSpec.nixl_block_size`;
* the side channel: prefill listens on ``PREFILL_SIDE_CHANNEL_PORT`` (container port
  ``nixl``), decode on ``DECODE_SIDE_CHANNEL_PORT``; each advertises its pod IP
  (``VLLM_NIXL_SIDE_CHANNEL_HOST`` from the downward API);
* UCX (NIXL's data path): RDMA device resources, ``IPC_LOCK`` for memory registration,
  ``UCX_TLS`` / ``UCX_NET_DEVICES`` / further ``UCX_*`` variables, alike in both roles.
"""

from __future__ import annotations

from typing import Any

from flowprefill.contracts.deployment import DECODE_SIDE_CHANNEL_PORT, PREFILL_SIDE_CHANNEL_PORT
from flowprefill.contracts.engine import NixlSettings
from flowprefill.contracts.nixl import SIDE_CHANNEL_HOST_ENV

from ..models import ServingPoolSpec
from ..models.kvhandoff import NixlHandoff
from .model import model_dir

NIXL_PORT_NAME = "nixl"
NIXL_DECODE_PORT_NAME = "nixl-decode"
IPC_LOCK = "IPC_LOCK"


def uses_nixl(spec: ServingPoolSpec) -> bool:
    """Whether the pool hands KV off over NIXL (its transport in effect)."""
    return spec.transport == "nixl"


def _nixl(spec: ServingPoolSpec) -> NixlHandoff:
    kv = spec.kv
    return kv.nixl if kv and kv.nixl else NixlHandoff()


def side_channel_port(spec: ServingPoolSpec) -> int:
    """The pod's NIXL handshake port: prefill's (decode connects to it) or decode's own; a
    colocated pod has both (:func:`container_ports`), and this is prefill's."""
    return DECODE_SIDE_CHANNEL_PORT if spec.role == "decode" else PREFILL_SIDE_CHANNEL_PORT


def served_model(spec: ServingPoolSpec) -> str:
    """Decode's ``--model`` argument as the operator renders it for this model."""
    return model_dir(spec.model)


def producer_settings(spec: ServingPoolSpec) -> NixlSettings:
    """Prefill's engine.json ``kv.nixl``: the side-channel port, decode's ``--model``
    string, the buffer and the block size; ``advertise_host`` stays null so that the
    engine reads the pod IP from ``VLLM_NIXL_SIDE_CHANNEL_HOST``."""
    nixl = _nixl(spec)
    return NixlSettings(
        side_channel_port=PREFILL_SIDE_CHANNEL_PORT,
        served_model=served_model(spec),
        buffer_mb=float(nixl.buffer_mib),
        block_size=spec.nixl_block_size,
    )


def decode_block_size_args(spec: ServingPoolSpec) -> list[str]:
    """``--block-size N`` for a decode pool with nixl (prefill lays blocks out the same)."""
    return ["--block-size", str(spec.nixl_block_size)] if uses_nixl(spec) else []


def container_env(spec: ServingPoolSpec) -> list[dict[str, Any]]:
    """The pod IP as ``VLLM_NIXL_SIDE_CHANNEL_HOST`` (downward API), then the UCX
    variables; empty without nixl."""
    if not uses_nixl(spec):
        return []
    host = {"name": SIDE_CHANNEL_HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    ucx = _nixl(spec).ucx
    variables = ucx.container_env() if ucx else {}
    return [host, *({"name": k, "value": v} for k, v in variables.items())]


def container_ports(spec: ServingPoolSpec) -> list[dict[str, Any]]:
    """The side channel as container port ``nixl`` (a colocated pod: prefill's, and
    decode's as ``nixl-decode``); empty without nixl. UCX's data path
    uses ephemeral ports besides (docs/operator.md, KV transport)."""
    if not uses_nixl(spec):
        return []
    ports = [{"name": NIXL_PORT_NAME, "containerPort": side_channel_port(spec), "protocol": "TCP"}]
    if spec.role == "colocated":  # decode's own side channel, beside prefill's in one pod
        ports.append(
            {"name": NIXL_DECODE_PORT_NAME, "containerPort": DECODE_SIDE_CHANNEL_PORT,
             "protocol": "TCP"}
        )  # fmt: skip
    return ports


def rdma_resources(spec: ServingPoolSpec) -> dict[str, str]:
    """RDMA device resources per pod (requests and limits); empty without nixl."""
    rdma = _nixl(spec).rdma if uses_nixl(spec) else None
    return dict(rdma.resources) if rdma else {}


def capabilities_add(spec: ServingPoolSpec) -> list[str]:
    """Capabilities the container adds: ``IPC_LOCK`` with nixl and ``ipcLock`` (explicit,
    or implied by RDMA resources); the Pod Security Standard ``restricted`` refuses it."""
    return [IPC_LOCK] if uses_nixl(spec) and _nixl(spec).wants_ipc_lock else []
