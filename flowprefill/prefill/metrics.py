"""Prometheus metrics of a prefill instance (names follow Prometheus conventions).

Each engine gets its own :class:`~prometheus_client.CollectorRegistry` so several engines
(tests, ``flowprefill up`` with N instances in one process) never collide; the server
exposes it at ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flowprefill.contracts.metrics import (
    KV_REFUSED_REASON_LABEL,
    OUTCOME_LABEL,
    PREFILL_DECODE_PARK_TIMEOUTS,
    PREFILL_DECODE_PARK_VETOES,
    PREFILL_DECODE_PARKED,
    PREFILL_DECODE_PARKS,
    PREFILL_KV_BUDGET_BYTES,
    PREFILL_KV_HELD_BYTES,
    PREFILL_KV_REFUSED,
    PREFILL_PARKED_BUDGET_BYTES,
    PREFILL_PARKED_BYTES,
    PREFILL_PREEMPTION_BLOCKING,
    PREFILL_PREEMPTION_HANDOFF,
    PREFILL_PREEMPTIONS_DECLINED,
    PREFILL_QUEUE_DEPTH,
    PREFILL_REQUESTS,
    PREFILL_TTFT,
    SLO_CLASS_LABEL,
    TTFT_BUCKETS_S,
)
from flowprefill.errors import KVBudgetExceededError

# Operator-level blocking lives in the 0.1–10 ms range, layer-level up to ~100 ms here.
BLOCKING_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            PREFILL_QUEUE_DEPTH,
            "Requests in the prefill instance that have no first token yet.",
            registry=r,
        )
        self.preempted_tasks = Gauge(
            "flowprefill_prefill_preempted_tasks",
            "Execution tasks currently parked at a checkpoint.",
            registry=r,
        )
        self.preemptions = Counter(
            "flowprefill_prefill_preemptions",
            "Preemptions of a running prefill task.",
            registry=r,
        )
        self.parked_bytes = Gauge(
            PREFILL_PARKED_BYTES,
            "Bytes (activations and KV cache) held by parked tasks, measured once parked.",
            registry=r,
        )
        self.parked_budget_bytes = Gauge(
            PREFILL_PARKED_BUDGET_BYTES,
            "Budget for the bytes parked tasks may hold (+Inf: unbounded).",
            registry=r,
        )
        self.parked_budget_bytes.set(float("inf"))
        self.preemptions_declined = Counter(
            PREFILL_PREEMPTIONS_DECLINED,
            "Scheduling rounds that left the running task running because parking it "
            "would have exceeded the parked-memory budget.",
            registry=r,
        )
        self.preemption_blocking = Histogram(
            PREFILL_PREEMPTION_BLOCKING,
            "Time from raising the preemption signal to the running task's ACK.",
            buckets=BLOCKING_BUCKETS_S,
            registry=r,
        )
        self.preemption_handoff = Histogram(
            PREFILL_PREEMPTION_HANDOFF,
            "Of the preemption blocking, the part from the checkpoint that took the signal "
            "to the scheduler seeing the ACK (device drain, GIL, thread wake-ups); the rest "
            "is the operator the signal landed in.",
            buckets=BLOCKING_BUCKETS_S,
            registry=r,
        )
        self.decode_parks = Counter(
            PREFILL_DECODE_PARKS,
            "Times the running prefill parked at a checkpoint for a decode step whose TBT "
            "target was at risk (decode-aware preemption).",
            registry=r,
        )
        self.decode_parked = Counter(
            PREFILL_DECODE_PARKED,
            "Time the running prefill spent parked for decode steps (decode-aware preemption).",
            registry=r,
        )
        self.decode_park_timeouts = Counter(
            PREFILL_DECODE_PARK_TIMEOUTS,
            "Parks for decode that ended at their bound without the step's end beat "
            "(a lost beat, or a decode step slower than the bound).",
            registry=r,
        )
        self.decode_park_vetoes = Counter(
            PREFILL_DECODE_PARK_VETOES,
            "Parks for decode not taken because they would have cost the running prefill, "
            "or the most urgent waiting one, its TTFT deadline (decode-aware preemption).",
            registry=r,
        )
        self.rounds = Counter(
            "flowprefill_prefill_scheduling_rounds",
            "Scheduling rounds (one per wake-up by arrival/completion events).",
            registry=r,
        )
        self.command_rounds = Counter(
            "flowprefill_prefill_scheduling_command_rounds",
            "Scheduling rounds that issued a submit, preempt or resume.",
            registry=r,
        )
        self.batch_size = Histogram(
            "flowprefill_prefill_batch_requests",
            "Requests per submitted execution task.",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.ttft = Histogram(
            PREFILL_TTFT,
            "Time from the request's arrival at the gateway to the first token, by SLO class.",
            [SLO_CLASS_LABEL],
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.requests = Counter(
            PREFILL_REQUESTS,
            "Finished requests by SLO class and outcome: met or missed the class's TTFT SLO "
            "(from the gateway's arrival), failed, cancelled.",
            [SLO_CLASS_LABEL, OUTCOME_LABEL],
            registry=r,
        )
        self.kv_held_bytes = Gauge(
            PREFILL_KV_HELD_BYTES,
            "Bytes of prompt KV held for decode (hand-off files, or leased NIXL blocks).",
            registry=r,
        )
        self.kv_budget_bytes = Gauge(
            PREFILL_KV_BUDGET_BYTES,
            "The most prompt KV the instance holds for decode (0: no hand-off).",
            registry=r,
        )
        self.kv_refused = Counter(
            PREFILL_KV_REFUSED,
            "Finished prompts that got no KV hand-off (decode recomputes them), by reason: "
            "budget (the KV held for decode is at its budget) or error.",
            [KV_REFUSED_REASON_LABEL],
            registry=r,
        )

    def count_kv_refusal(self, error: BaseException) -> None:
        """A finished prompt got no KV hand-off because of ``error``: ``budget`` when the
        KV held for decode is at its budget, else ``error``."""
        reason = "budget" if isinstance(error, KVBudgetExceededError) else "error"
        self.kv_refused.labels(reason).inc()

    def watch_kv(self, held_bytes: Callable[[], float], budget_bytes: float) -> None:
        """Report the KV held for decode as ``held_bytes()`` reads at each scrape."""
        self.kv_held_bytes.set_function(held_bytes)
        self.kv_budget_bytes.set(budget_bytes)
