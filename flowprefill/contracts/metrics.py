"""Prometheus metric names and label values that other processes read.

The operator scrapes the gateway's SLO counters into SLOClass status, dashboards read the
prefill instance's; both sides import the names from here. Names follow Prometheus
conventions (``_seconds`` units; counters are exposed with a ``_total`` suffix).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class Outcome(StrEnum):
    """``outcome`` label of the request counters: judged against the request's TTFT target
    (its class's, or its own where the gateway honoured one), from the gateway's arrival
    (see :mod:`flowprefill.contracts.slo`)."""

    MET = "met"
    MISSED = "missed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @classmethod
    def of(cls, met_slo: bool) -> Outcome:
        return cls.MET if met_slo else cls.MISSED


SLO_CLASS_LABEL: Final = "slo_class"
OUTCOME_LABEL: Final = "outcome"

# Gateway (flowprefill serve-gateway); the SLO counters feed SLOClass status.
GATEWAY_SLO_REQUESTS: Final = "flowprefill_gateway_slo_requests"
GATEWAY_TTFT: Final = "flowprefill_gateway_ttft_seconds"
GATEWAY_CLAIMS_REFUSED: Final = "flowprefill_gateway_slo_claims_refused"
"""Counter: requests whose claim (a class by name, a priority, a tighter TTFT target) the
class's claim rule did not admit, by ``slo_class`` (the class claimed) and ``claim``."""
CLAIM_LABEL: Final = "claim"
GATEWAY_TPOT: Final = "flowprefill_gateway_tpot_seconds"
"""Histogram by class: time per output token after the first, of each request that
decode continued ((last token - first token) / (tokens - 1)); the operator's autoscaler
sizes decode pools from its p90."""
GATEWAY_PREFILL_WORK: Final = "flowprefill_gateway_prefill_work_seconds"
"""Counter by class: predicted device-seconds of the prefills the gateway had served (the
TTFT profile's time for each prompt): its rate is the load offered to the prefill pool in
replicas' worth, the autoscaler's guard against scaling down into saturation."""
GATEWAY_SHED: Final = "flowprefill_gateway_shed"
"""Counter by class: requests refused at admission (HTTP 429) because they could not be
served before their deadline; the operator writes the window's count into SLOClass status."""
GATEWAY_OVERLOAD_REFUSED: Final = "flowprefill_gateway_overload_refused"
"""Counter by class and ``reason`` (:class:`OverloadReason`): requests answered 503 with
``Retry-After`` because waiting would be of no use or the gateway's queue is full."""
OVERLOAD_REASON_LABEL: Final = "reason"
GATEWAY_WAITING: Final = "flowprefill_gateway_waiting_requests"
"""Gauge: requests admitted and waiting for their first token (the gateway's queue)."""
GATEWAY_WAITING_MAX: Final = "flowprefill_gateway_waiting_requests_max"
"""Gauge: the most requests that ever waited at once since the gateway started."""


class OverloadReason(StrEnum):
    """Why a request got 503 under overload (docs/gateway.md, "Overload")."""

    TOO_LATE = "too_late"
    """Its first token was predicted past its deadline plus its useful wait."""
    EXPIRED = "expired"
    """Admitted, but still without a first token at its deadline plus its useful wait."""
    QUEUE_FULL = "queue_full"
    """``overload.max_waiting`` requests were already waiting for their first token."""


# Prefill instance (flowprefill serve-prefill).
PREFILL_REQUESTS: Final = "flowprefill_prefill_requests"
PREFILL_QUEUE_DEPTH: Final = "flowprefill_prefill_queue_depth"
PREFILL_TTFT: Final = "flowprefill_prefill_ttft_seconds"
PREFILL_PREEMPTION_BLOCKING: Final = "flowprefill_prefill_preemption_blocking_seconds"
"""Histogram: preemption signal → the running task's ACK."""
PREFILL_PREEMPTION_HANDOFF: Final = "flowprefill_prefill_preemption_handoff_seconds"
"""Histogram: of that blocking, the checkpoint that took the signal → the ACK seen (device
drain, GIL, wake-ups); the rest is the operator the signal landed in."""
PREFILL_DECODE_PARKS: Final = "flowprefill_prefill_decode_parks"
"""Counter: parks of the running prefill for a decode step (decode-aware preemption)."""
PREFILL_DECODE_PARKED: Final = "flowprefill_prefill_decode_parked_seconds"
PREFILL_DECODE_PARK_TIMEOUTS: Final = "flowprefill_prefill_decode_park_timeouts"
PREFILL_DECODE_PARK_VETOES: Final = "flowprefill_prefill_decode_park_vetoes"
"""Counter: parks not taken because they would have cost a TTFT deadline."""
PREFILL_PARKED_BYTES: Final = "flowprefill_prefill_parked_bytes"
"""Gauge: bytes held by preempted (parked) tasks, as measured once each parked."""
PREFILL_PARKED_BUDGET_BYTES: Final = "flowprefill_prefill_parked_memory_budget_bytes"
"""Gauge: the engine's ``parked_memory_bytes`` (+Inf when unbounded)."""
PREFILL_PREEMPTIONS_DECLINED: Final = "flowprefill_prefill_preemptions_declined"
"""Counter: scheduling rounds in which a more urgent entry did not preempt the running
task because parking it would have exceeded the parked-memory budget."""
PREFILL_KV_HELD_BYTES: Final = "flowprefill_prefill_kv_held_bytes"
"""Gauge: bytes of prompt KV the instance holds for decode (hand-off files in its
directory, or leased blocks of its NIXL buffer, all ranks)."""
PREFILL_KV_BUDGET_BYTES: Final = "flowprefill_prefill_kv_budget_bytes"
"""Gauge: the most it may hold (``kv.budget_mb``, or the NIXL buffer of all ranks)."""
PREFILL_KV_REFUSED: Final = "flowprefill_prefill_kv_handoffs_refused"
"""Counter by reason (``budget``, ``error``): finished prompts that got no KV hand-off, so
decode recomputes them."""
KV_REFUSED_REASON_LABEL: Final = "reason"

# Operator (flowprefill_operator): the autoscaler's decisions.
OPERATOR_AUTOSCALER_DESIRED_REPLICAS: Final = "flowprefill_operator_autoscaler_desired_replicas"
"""Gauge by namespace and pool: replicas the autoscaler last decided on."""
OPERATOR_AUTOSCALER_DECISIONS: Final = "flowprefill_operator_autoscaler_decisions"
"""Counter by namespace, pool and direction (up, down): replica changes it wrote."""
NAMESPACE_LABEL: Final = "namespace"
POOL_LABEL: Final = "pool"
DIRECTION_LABEL: Final = "direction"

TTFT_BUCKETS_S: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
"""Histogram buckets of every TTFT metric (the classes' SLOs span 0.25 s to 18 s)."""

TPOT_BUCKETS_S: Final = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
"""Histogram buckets of the TPOT metric (decode targets are tens of milliseconds)."""

GATEWAY_SLO_ATTAINMENT_TARGET: Final = "flowprefill_gateway_slo_attainment_target"
"""Gauge by ``slo_class``: the class's attainment target from the gateway's SLO table; the
recording rules (charts/flowprefill/files/recording-rules.yaml) divide the missed fraction
by 1 minus it (error-budget burn rate)."""
