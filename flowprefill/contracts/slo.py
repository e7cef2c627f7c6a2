"""SLO classes as the gateway sees them (``slo-table.json``) and the paper's SLO table.

The deadline has one name and one unit from the gateway to the scheduler: a class's
``ttft_slo_s`` (the table file carries ``ttft_slo_ms``, as the SLOClass CRD does, and is
converted here, once), and ``deadline_s = arrival_s + ttft_slo_s`` where ``arrival_s`` is
when the *gateway* received the request. Whether a request met its SLO is judged against
that same ``ttft_slo_s`` from that arrival, in every process: the class's, or the request's
own target (``x-slo-ttft-ms``) where the gateway honoured one (its class's
:class:`SLOTableClaim` decides; docs/gateway.md).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Contract(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


PAPER_TTFT_SLOS_S: dict[str, dict[str, float]] = {
    # Paper Table 2: TTFT SLOs per task type (text / image / search / file), seconds.
    "llama3-8b": {"text": 0.25, "image": 0.5, "search": 4.0, "file": 6.0},
    "qwen2.5-14b": {"text": 0.4, "image": 0.8, "search": 6.5, "file": 9.0},
    "llama3-70b": {"text": 1.0, "image": 2.0, "search": 15.0, "file": 18.0},
}
PAPER_TBT_SLOS_S: dict[str, float] = {"text": 0.1, "image": 0.1, "search": 0.2, "file": 0.2}


def deadline_s(arrival_s: float, ttft_slo_s: float) -> float:
    """When a request's first token is due: its gateway arrival plus its TTFT target."""
    return arrival_s + ttft_slo_s


def met_slo(ttft_s: float, ttft_slo_s: float) -> bool:
    """Whether a first token ``ttft_s`` after the gateway arrival met the TTFT target; every
    process (gateway, prefill engine, simulator) judges attainment with this function."""
    return ttft_s <= ttft_slo_s


"""§6.5 (the PD-colocated evaluation): time-between-tokens SLO per task type, seconds, the
same for every model. ``flowprefill bench`` judges each request's every inter-token gap
against it (docs/bench.md). Not scaled with the TTFT SLOs."""
PAPER_PRIORITIES: dict[str, int] = {"text": 30, "image": 20, "search": 10, "file": 0}
"""Priorities of the four task types in the example SLOClasses and ``flowprefill up``."""
TASK_TYPES = ("text", "image", "search", "file", "other")


def paper_ttft_slos_s(model: str = "llama3-8b") -> dict[str, float]:
    """Table 2's TTFT SLO per task type for ``model`` (a copy)."""
    try:
        return dict(PAPER_TTFT_SLOS_S[model])
    except KeyError:
        raise ValueError(
            f"the paper gives no SLOs for {model!r}; known: {', '.join(PAPER_TTFT_SLOS_S)}"
        ) from None


class SLOTableMatch(_Contract):
    """Match rules of one class (see the SLOClass CRD for semantics)."""

    headers: dict[str, str] = Field(default_factory=dict, description="Header name -> value.")
    models: list[str] = Field(default_factory=list, description="Model names.")
    paths: list[str] = Field(default_factory=list, description="Path prefixes.")
    api_key_hashes: list[str] = Field(default_factory=list, description="SHA-256 of API keys.")


class Fallback(StrEnum):
    """Why a request did not get what it asked for: the first word of each entry of the
    ``x-flowprefill-slo-class-fallback`` answer header; the ``claim`` label of the refused
    claims counter is the part after ``claim-`` / ``ttft-``."""

    UNKNOWN_CLASS = "unknown-class"
    """It named a class the table does not have."""
    CLASS_REFUSED = "claim-refused"
    """It named a class whose claim rule does not admit it."""
    PRIORITY_REFUSED = "priority-refused"
    """The class nearest its priority does not admit it; the nearest that does was used."""
    TTFT_REFUSED = "ttft-refused"
    """It asked for a TTFT target tighter than its class, which does not allow it."""
    TTFT_LIMITED = "ttft-limited"
    """It asked for a tighter target than the class's floor; the floor was used."""


class SLOTableClaim(_Contract):
    """Who may put a request into this class by naming it (``x-slo-class``, the
    ``slo_class`` field, ``x-gateway-inference-objective``) or by a priority, and how far
    such a client may tighten the TTFT target per request (``x-slo-ttft-ms``).

    The default admits nobody: a client gets a class by naming it only where its API key
    is listed or ``anyone`` is set. Match rules are not claims: they are the operator's
    own assignment, and the class they give is always the client's to keep.
    """

    anyone: bool = Field(default=False, description="Every client may claim the class.")
    api_key_hashes: list[str] = Field(
        default_factory=list, description="SHA-256 of the API keys that may claim it."
    )
    min_ttft_slo_ms: int | None = Field(
        default=None,
        gt=0,
        description="The tightest per-request TTFT target (ms) a client allowed to claim "
        "the class may ask for; null: none tighter than the class's.",
    )


class SLOTableClass(_Contract):
    """One SLO class as the gateway sees it."""

    name: str = Field(description="SLOClass name; also the value of the x-slo-class header.")
    task_type: str = Field(description="text, image, search, file or other.")
    ttft_slo_ms: int = Field(gt=0, description="TTFT target in ms; deadline = arrival + this.")
    tpot_slo_ms: int | None = Field(default=None, description="TPOT target in ms, if any.")
    priority: int = Field(description="Higher is more urgent; negative = sheddable.")
    attainment_target: float = Field(description="Target fraction of requests meeting the TTFT.")
    match: SLOTableMatch = Field(default_factory=SLOTableMatch, description="Match rules.")
    claim: SLOTableClaim = Field(
        default_factory=SLOTableClaim, description="Who may claim the class (default: nobody)."
    )

    @property
    def ttft_slo_s(self) -> float:
        """The class's TTFT SLO in seconds: the unit every process works in."""
        return self.ttft_slo_ms / 1e3


class SLOTable(_Contract):
    """``slo-table.json``: classes in the order the gateway tries them.

    Classification (:mod:`flowprefill.gateway.classify`): a class the client names and may
    claim (:class:`SLOTableClaim`); else the claimable class nearest a priority it sent;
    otherwise the first class (priority descending, then name) whose non-empty rules all
    match; otherwise ``default_class``; if that is null the request is refused (400).
    """

    version: Literal[1] = Field(default=1, description="Format version.")
    default_class: str | None = Field(description="Class for requests matching no rule.")
    classes: list[SLOTableClass] = Field(description="Classes, most urgent first.")

    @model_validator(mode="after")
    def _consistent(self) -> SLOTable:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError("class names must be unique")
        if self.default_class is not None and self.default_class not in names:
            raise ValueError(f"default_class {self.default_class!r} is not a class")
        return self

    def open_to_anyone(self) -> SLOTable:
        """The table with every class claimable by every client, its TTFT target
        tightened freely: single-tenant deployments (``flowprefill up``)."""
        claim = SLOTableClaim(anyone=True, min_ttft_slo_ms=1)
        classes = [c.model_copy(update={"claim": claim}) for c in self.classes]
        return self.model_copy(update={"classes": classes})

    @classmethod
    def paper(cls, *, scale: float = 1.0, model: str = "llama3-8b") -> SLOTable:
        """The paper's four task types as classes, Table 2's targets times ``scale`` (no
        class claimable by name: see :meth:`open_to_anyone`)."""
        return cls(
            default_class="text",
            classes=[
                SLOTableClass(
                    name=name,
                    task_type=name,
                    ttft_slo_ms=max(1, round(slo_s * scale * 1e3)),
                    priority=PAPER_PRIORITIES[name],
                    attainment_target=0.9,
                )
                for name, slo_s in paper_ttft_slos_s(model).items()
            ],
        )
