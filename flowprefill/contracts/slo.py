"""SLO classes as the gateway sees them (``slo-table.json``) and the paper's SLO table.

The deadline has one name and one unit from the gateway to the scheduler: a class's
``ttft_slo_s`` (the table file carries ``ttft_slo_ms``, as the SLOClass CRD does, and is
converted here, once), and ``deadline_s = arrival_s + ttft_slo_s`` where ``arrival_s`` is
when the *gateway* received the request. Whether a request met its SLO is judged against
the class SLO from that arrival, in every process.
"""

from __future__ import annotations

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


class SLOTableClass(_Contract):
    """One SLO class as the gateway sees it."""

    name: str = Field(description="SLOClass name; also the value of the x-slo-class header.")
    task_type: str = Field(description="text, image, search, file or other.")
    ttft_slo_ms: int = Field(gt=0, description="TTFT target in ms; deadline = arrival + this.")
    tpot_slo_ms: int | None = Field(default=None, description="TPOT target in ms, if any.")
    priority: int = Field(description="Higher is more urgent; negative = sheddable.")
    attainment_target: float = Field(description="Target fraction of requests meeting the TTFT.")
    match: SLOTableMatch = Field(default_factory=SLOTableMatch, description="Match rules.")

    @property
    def ttft_slo_s(self) -> float:
        """The class's TTFT SLO in seconds: the unit every process works in."""
        return self.ttft_slo_ms / 1e3


class SLOTable(_Contract):
    """``slo-table.json``: classes in the order the gateway tries them.

    Classification: an ``x-slo-class`` header naming a class wins; otherwise the first class
    (priority descending, then name) whose non-empty rules all match; otherwise
    ``default_class``; if that is null the request is refused (400).
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

    @classmethod
    def paper(cls, *, scale: float = 1.0, model: str = "llama3-8b") -> SLOTable:
        """The paper's four task types as classes, Table 2's targets times ``scale``."""
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
