"""The ports every renderer takes from :mod:`flowprefill.contracts.deployment`."""

from __future__ import annotations

from flowprefill.contracts.deployment import (
    DECODE_PORT,
    GATEWAY_PORT,
    PREFILL_KV_PORT,
    PREFILL_PORT,
)

MAX_INSTANCES_PER_ROLE = 100


def test_ports_leave_each_role_room_for_its_instances() -> None:
    """In a pod each process has its ports to itself; ``flowprefill up`` puts a whole stack
    on one host, one gateway at ``--port`` and each role's instance i at ``--port`` +
    (its port - GATEWAY_PORT) + i, so no two may meet. The KV port differs from prefill's
    API port: a NetworkPolicy tells them apart by number alone."""
    ports = [GATEWAY_PORT]
    for first in (PREFILL_PORT, DECODE_PORT, PREFILL_KV_PORT):
        ports += range(first, first + MAX_INSTANCES_PER_ROLE)
    assert len(ports) == len(set(ports))
