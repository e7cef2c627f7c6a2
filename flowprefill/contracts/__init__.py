"""Every fact that crosses a process boundary, in one torch-free package.

The engine, the gateway, the KV connector, ``flowprefill up`` and the operator all import
these; none spells a port, a file path, an environment variable, a name or a wire format
of its own. Importing this package never imports torch, transformers or vLLM (a test
checks it), so the gateway and the operator stay light.

- :mod:`~flowprefill.contracts.names`: policies, batching modes, granularities, routers,
  transports — enums with one parser.
- :mod:`~flowprefill.contracts.deployment`: ports, paths, readiness endpoints, env vars.
- :mod:`~flowprefill.contracts.engine`: ``engine.json`` (a prefill instance's settings).
- :mod:`~flowprefill.contracts.gateway`: ``gateway.json``.
- :mod:`~flowprefill.contracts.slo`: ``slo-table.json`` and the paper's SLO table.
- :mod:`~flowprefill.contracts.prefill_api`: the prefill instance's HTTP API.
- :mod:`~flowprefill.contracts.kv`: the hand-off reference and the vLLM connector config.
- :mod:`~flowprefill.contracts.metrics`: Prometheus metric names shared across processes.
- :mod:`~flowprefill.contracts.processes`: the processes of a deployment (argv, env, port,
  readiness), rendered by ``flowprefill up`` and by the operator's builders alike.
"""

from flowprefill.contracts.engine import EngineConfig, KVHandoffSettings, NixlSettings
from flowprefill.contracts.gateway import Endpoint, GatewayConfig
from flowprefill.contracts.names import (
    Admission,
    Batching,
    DType,
    Granularity,
    Kernels,
    KVTransport,
    Name,
    Policy,
    Role,
    Router,
)
from flowprefill.contracts.slo import SLOTable, SLOTableClass, SLOTableMatch

__all__ = [
    "Admission",
    "Batching",
    "DType",
    "Endpoint",
    "EngineConfig",
    "GatewayConfig",
    "Granularity",
    "KVHandoffSettings",
    "KVTransport",
    "Kernels",
    "Name",
    "NixlSettings",
    "Policy",
    "Role",
    "Router",
    "SLOTable",
    "SLOTableClass",
    "SLOTableMatch",
]
