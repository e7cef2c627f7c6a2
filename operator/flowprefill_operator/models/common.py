"""Base model and shared pieces of the custom resources (camelCase on the wire)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonDict

DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"


def cel(rule: str, message: str) -> JsonDict:
    """One ``x-kubernetes-validations`` entry (a CEL rule the API server enforces)."""
    return {"rule": rule, "message": message}


class CRModel(BaseModel):
    """Wire model: camelCase aliases, unknown fields refused, immutable once parsed."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )

    def wire(self) -> dict[str, Any]:
        """The object as the API server stores it (camelCase, no nulls)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class LabelSelectorRequirement(CRModel):
    """A set-based label requirement, as in Kubernetes' LabelSelector."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    # values is optional on the wire: has() before size() (an absent
                    # field is an error in CEL, not an empty list).
                    "self.operator in ['In', 'NotIn']"
                    " ? (has(self.values) && size(self.values) > 0)"
                    " : (!has(self.values) || size(self.values) == 0)",
                    "In/NotIn need values; Exists/DoesNotExist take none",
                )
            ]
        }
    )

    key: str = Field(max_length=317, description="Label key the requirement applies to.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="How the key relates to the values."
    )
    values: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Values for In/NotIn; must be empty for Exists/DoesNotExist.",
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> LabelSelectorRequirement:
        if (self.operator in ("In", "NotIn")) != bool(self.values):
            raise ValueError("In/NotIn need values; Exists/DoesNotExist take none")
        return self


class LabelSelector(CRModel):
    """Kubernetes label selector; an empty selector matches everything."""

    match_labels: dict[str, str] = Field(
        default_factory=dict, description="Labels that must all be present with these values."
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list,
        max_length=32,
        description="Set-based requirements that must all hold.",
    )

    def matches(self, labels: dict[str, str]) -> bool:
        """Whether ``labels`` satisfy this selector (same semantics as the API server)."""
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        for req in self.match_expressions:
            present = req.key in labels
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
            if req.operator == "In" and labels.get(req.key) not in req.values:
                return False
            if req.operator == "NotIn" and present and labels[req.key] in req.values:
                return False
        return True


class Condition(CRModel):
    """A Kubernetes-style status condition."""

    type: str = Field(description="Condition type (e.g. Ready, Progressing, Degraded).")
    status: Literal["True", "False", "Unknown"] = Field(description="Condition status.")
    reason: str = Field(default="", description="One-word CamelCase reason.")
    message: str = Field(default="", description="Human-readable details.")
    last_transition_time: str | None = Field(
        default=None, description="When the status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation this condition was computed for."
    )
