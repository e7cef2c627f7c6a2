"""One request on its way through the gateway, and its deadline.

The deadline has one name and one unit from here to the scheduler: the request's
``ttft_slo_s`` (its class's, or its own target where the classifier honoured one) and
``arrival_s``, when the gateway received the request, so
``deadline_s = arrival_s + ttft_slo_s``. A prefill instance is sent ``ttft_slo_s`` and
``elapsed_s`` (:mod:`flowprefill.contracts.prefill_api`) and rebuilds the same deadline
on its clock; every process judges ``met`` as ``ttft_s <= ttft_slo_s`` from that arrival.
The one derived quantity, the ``x-slo-ttft-ms`` hint for upstreams (the budget left when a
call is sent), is computed here and nowhere else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from flowprefill.contracts import SLOTableClass
from flowprefill.contracts import slo as slo_contract
from flowprefill.contracts.deployment import (
    SLO_OBJECTIVE_HEADER,
    SLO_PRIORITY_HEADER,
    SLO_TPOT_HEADER,
    SLO_TTFT_HEADER,
)
from flowprefill.gateway.classify import Classification
from flowprefill.gateway.openai_models import ChatCompletionRequest, CompletionRequest

Kind = Literal["text_completion", "chat.completion"]
"""The OpenAI object a request answers with (also the relay's wire format)."""


@dataclass(eq=False)
class Job:
    """A request the gateway admitted: its class, tokens and deadline. The decode stage
    sets ``num_completion_tokens`` from decode's usage report."""

    request_id: str
    kind: Kind
    body: CompletionRequest | ChatCompletionRequest
    token_ids: list[int]
    classification: Classification
    arrival_s: float
    """When the gateway received the request (the gateway's monotonic clock)."""
    created: int = field(default_factory=lambda: int(time.time()))
    """Unix time, for the OpenAI ``created`` field."""
    num_completion_tokens: int = 1
    """The first token; decode's usage adds the rest."""

    @property
    def slo(self) -> SLOTableClass:
        return self.classification.slo_class

    @property
    def ttft_slo_s(self) -> float:
        """The request's TTFT target: its class's, or its own where honoured."""
        return self.classification.ttft_slo_s

    @property
    def deadline_s(self) -> float:
        return slo_contract.deadline_s(self.arrival_s, self.ttft_slo_s)

    def elapsed_s(self, now_s: float) -> float:
        return max(0.0, now_s - self.arrival_s)

    def met_slo(self, ttft_s: float) -> bool:
        return slo_contract.met_slo(ttft_s, self.ttft_slo_s)

    def upstream_hints(self, now_s: float) -> dict[str, str]:
        """llm-d / Dynamo-style headers for upstreams that understand them: the class, the
        TTFT budget left at ``now_s`` (ms, at least 1), the priority, the TPOT target."""
        c = self.slo
        headers = {
            SLO_OBJECTIVE_HEADER: c.name,
            SLO_TTFT_HEADER: str(max(1, round((self.deadline_s - now_s) * 1e3))),
            SLO_PRIORITY_HEADER: str(c.priority),
        }
        if c.tpot_slo_ms is not None:
            headers[SLO_TPOT_HEADER] = str(c.tpot_slo_ms)
        return headers
