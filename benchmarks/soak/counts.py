"""Do the gateway's counters agree with what the client saw? (for ``benchmarks/soak/soak.py``)

Two ``/metrics`` pages of the gateway, one scraped before the load and one after it, give
the load's deltas; the client's outcomes give its own counts. They must be equal:

* per class, requests whose first token reached the client (``ttft_s`` set) = the delta of
  ``flowprefill_gateway_slo_requests_total{slo_class}`` summed over ``outcome`` (the
  gateway counts a request there when it sends the first token, met or missed);
* requests that ended in an error, all classes together (the gateway's error counter has
  no class label) = the delta of ``flowprefill_gateway_errors_total`` summed over
  ``reason``; an error after the first token (a broken decode stream) is in both counts;
* claims the gateway refused: 0 (the soak names only classes ``up`` opens to anyone, so a
  refusal would put requests in another class than the client counts them in).

Met / missed are reported side by side but not compared: the client times from sending,
the gateway from arrival, so a request at the edge of its SLO may fall either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from flowprefill.bench.client import Outcome
from flowprefill.contracts.metrics import (
    GATEWAY_CLAIMS_REFUSED,
    GATEWAY_SLO_REQUESTS,
    OUTCOME_LABEL,
    SLO_CLASS_LABEL,
)
from flowprefill.contracts.metrics import Outcome as CounterOutcome

GATEWAY_ERRORS = "flowprefill_gateway_errors"
"""flowprefill/gateway/metrics.py's error counter (not in flowprefill.contracts yet);
tests/benchmarks/test_soak.py reads it from the gateway's own metrics class, so a rename
fails there."""
REASON_LABEL = "reason"
GATEWAY_IN_FLIGHT = "flowprefill_gateway_in_flight_requests"
"""Gauges the soak plots, likewise named only in the gateway's and prefill's metrics."""
PREFILL_QUEUE_DEPTH = "flowprefill_prefill_queue_depth"

Labels = tuple[tuple[str, str], ...]
Page = dict[tuple[str, Labels], float]
"""A ``/metrics`` page: (sample name, sorted labels) -> value."""


def parse_page(text: str) -> Page:
    """Every sample of a Prometheus text page, labels kept (histogram buckets dropped)."""
    out: Page = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def counter_delta(before: Page, after: Page, counter: str, by: str) -> dict[str, float]:
    """``after - before`` of ``<counter>_total`` per value of the label ``by``, summed over
    every other label; zero deltas left out."""
    name = f"{counter}_total"
    out: dict[str, float] = {}
    for sign, page in ((-1.0, before), (1.0, after)):
        for (sample, labels), value in page.items():
            if sample == name:
                key = dict(labels).get(by, "")
                out[key] = out.get(key, 0.0) + sign * value
    return {k: v for k, v in out.items() if v != 0.0}


def only(page: Page, label: str, value: str) -> Page:
    """The samples of ``page`` whose ``label`` is ``value``."""
    return {k: v for k, v in page.items() if dict(k[1]).get(label) == value}


@dataclass
class ClassCounts:
    sent: int = 0
    first_token: int = 0
    errors: int = 0
    met: int = 0


@dataclass
class GatewayCounts:
    first_token: dict[str, float] = field(default_factory=dict)
    """Per class: the load's delta of the SLO request counter (met + missed)."""
    met: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    """Per reason."""
    claims_refused: float = 0.0


def client_counts(outcomes: Iterable[Outcome]) -> dict[str, ClassCounts]:
    out: dict[str, ClassCounts] = {}
    for o in outcomes:
        c = out.setdefault(o.slo_class, ClassCounts())
        c.sent += 1
        c.first_token += o.ttft_s is not None
        c.errors += o.error is not None
        c.met += o.met
    return out


def gateway_counts(before: Page, after: Page) -> GatewayCounts:
    met = OUTCOME_LABEL, CounterOutcome.MET.value
    return GatewayCounts(
        first_token=counter_delta(before, after, GATEWAY_SLO_REQUESTS, SLO_CLASS_LABEL),
        met=counter_delta(
            only(before, *met), only(after, *met), GATEWAY_SLO_REQUESTS, SLO_CLASS_LABEL
        ),
        errors=counter_delta(before, after, GATEWAY_ERRORS, REASON_LABEL),
        claims_refused=sum(
            counter_delta(before, after, GATEWAY_CLAIMS_REFUSED, SLO_CLASS_LABEL).values()
        ),
    )


@dataclass(frozen=True)
class Row:
    """One line of the reconciliation: what was counted, by whom, and whether it agrees."""

    what: str
    client: float
    gateway: float
    compared: bool = True
    """False: shown for information only (met / missed)."""

    @property
    def mismatch(self) -> bool:
        return self.compared and self.client != self.gateway


def reconcile(client: dict[str, ClassCounts], gateway: GatewayCounts) -> list[Row]:
    """The rows of the comparison (see the module docstring); ``mismatch`` marks a
    disagreement, including a class only one side counted."""
    rows: list[Row] = []
    for cls in sorted(set(client) | set(gateway.first_token)):
        c = client.get(cls, ClassCounts())
        rows.append(Row(f"{cls}: first tokens", c.first_token, gateway.first_token.get(cls, 0)))
        rows.append(Row(f"{cls}: met SLO", c.met, gateway.met.get(cls, 0), compared=False))
    rows.append(
        Row(
            "errors (all classes)",
            sum(c.errors for c in client.values()),
            sum(gateway.errors.values()),
        )
    )
    rows.append(Row("claims refused", 0, gateway.claims_refused))
    return rows
