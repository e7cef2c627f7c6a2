"""SLOClass: one latency tier (TTFT target, priority, match rules) the gateway serves."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from .common import Condition, CRModel, cel

TaskType = Literal["text", "image", "search", "file", "other"]
SHA256_HEX = r"^[a-f0-9]{64}$"
HEADER_NAME = r"^[a-z0-9][a-z0-9-]*$"


class HeaderMatch(CRModel):
    """An HTTP header that must carry exactly this value."""

    name: str = Field(
        max_length=64,
        pattern=HEADER_NAME,
        description="Header name, lower case (e.g. x-slo-class).",
    )
    value: str = Field(max_length=256, description="Exact header value.")


class SecretRef(CRModel):
    """A Secret in the SLOClass' namespace; every value in its data is one API key."""

    name: str = Field(max_length=253, description="Secret name.")


class MatchRules(CRModel):
    """How the gateway recognises a request of this class.

    Every non-empty criterion must hold (AND); within a criterion any entry may match (OR).
    Naming a class (``x-slo-class: <name>``) is a claim, not a rule (see ClaimRules): a
    header rule on ``x-slo-class`` would let every client in.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.apiKeySecretRef) || !has(self.apiKeyHashes)"
                    " || size(self.apiKeyHashes) == 0",
                    "set either apiKeyHashes or apiKeySecretRef, not both",
                )
            ]
        }
    )

    headers: list[HeaderMatch] = Field(
        default_factory=list,
        max_length=16,
        description="Headers that must all be present with these values.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    models: list[Annotated[str, Field(max_length=253)]] = Field(
        default_factory=list,
        max_length=64,
        description="Model names (the request's `model` field); any one may match.",
    )
    paths: list[Annotated[str, Field(max_length=256, pattern=r"^/")]] = Field(
        default_factory=list,
        max_length=32,
        description="Request path prefixes, e.g. /v1/chat/completions; any one may match.",
    )
    api_key_hashes: list[Annotated[str, Field(pattern=SHA256_HEX)]] = Field(
        default_factory=list,
        max_length=256,
        description="Lower-case hex SHA-256 of API keys (bearer tokens); never plaintext.",
    )
    api_key_secret_ref: SecretRef | None = Field(
        default=None,
        description="A Secret whose values are API keys; the operator hashes them into the table.",
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> MatchRules:
        if self.api_key_secret_ref and self.api_key_hashes:
            raise ValueError("set either apiKeyHashes or apiKeySecretRef, not both")
        return self


class ClaimRules(CRModel):
    """Who may put a request into this class by naming it (``x-slo-class``, the
    ``slo_class`` body field, ``x-llm-d-inference-objective`` or its alias
    ``x-gateway-inference-objective``) or by a priority (``x-dynamo-request-priority``,
    vLLM's ``priority``), and who may tighten its TTFT target per request
    (``x-llm-d-slo-ttft-ms``, alias ``x-slo-ttft-ms``). Empty: nobody — such requests get
    the class their match rules (or the default) give them, and the refusal is reported.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.apiKeySecretRef) || !has(self.apiKeyHashes)"
                    " || size(self.apiKeyHashes) == 0",
                    "set either apiKeyHashes or apiKeySecretRef, not both",
                ),
                cel(
                    "!has(self.anyone) || !self.anyone || (!has(self.apiKeySecretRef)"
                    " && (!has(self.apiKeyHashes) || size(self.apiKeyHashes) == 0))",
                    "anyone admits every client: list no API keys with it",
                ),
            ]
        }
    )

    anyone: bool = Field(
        default=False,
        description="Every client may claim the class (single-tenant setups; the behaviour "
        "before claim rules existed).",
    )
    api_key_hashes: list[Annotated[str, Field(pattern=SHA256_HEX)]] = Field(
        default_factory=list,
        max_length=256,
        description="Lower-case hex SHA-256 of the API keys (bearer tokens) that may claim it.",
    )
    api_key_secret_ref: SecretRef | None = Field(
        default=None,
        description="A Secret whose values are the API keys that may claim it; the operator "
        "hashes them into the table.",
    )
    min_ttft_slo_ms: int | None = Field(
        default=None,
        ge=1,
        le=600_000,
        description="The tightest per-request TTFT target (x-llm-d-slo-ttft-ms or "
        "x-slo-ttft-ms) a client admitted here may ask for in this class; unset: none "
        "tighter than ttftSloMs.",
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> ClaimRules:
        if self.api_key_secret_ref and self.api_key_hashes:
            raise ValueError("set either apiKeyHashes or apiKeySecretRef, not both")
        if self.anyone and (self.api_key_secret_ref or self.api_key_hashes):
            raise ValueError("anyone admits every client: list no API keys with it")
        return self


class SLOClassSpec(CRModel):
    """Desired state of an SLO class."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.claim) || !has(self.claim.minTtftSloMs)"
                    " || self.claim.minTtftSloMs <= self.ttftSloMs",
                    "claim.minTtftSloMs must not exceed ttftSloMs",
                )
            ]
        }
    )

    task_type: TaskType = Field(
        description="Task type (the paper's text/image/search/file, or other)."
    )
    ttft_slo_ms: int = Field(
        ge=1, le=600_000, description="Time-to-first-token target in milliseconds."
    )
    tpot_slo_ms: int | None = Field(
        default=None, ge=1, le=60_000, description="Optional time-per-output-token target in ms."
    )
    priority: int = Field(
        default=0,
        ge=-1000,
        le=1000,
        description="Higher is more urgent; negative priorities are sheddable under overload.",
    )
    attainment_target: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description="Fraction of requests that should meet the TTFT target (e.g. 0.9).",
    )
    default: bool = Field(
        default=False, description="Unmatched requests fall into this class (one per namespace)."
    )
    match: MatchRules = Field(
        default=MatchRules(), description="Rules that assign requests to this class."
    )
    claim: ClaimRules = Field(
        default=ClaimRules(),
        description="Who may claim this class by name or priority, and tighten its TTFT "
        "target per request (default: nobody).",
    )

    @model_validator(mode="after")
    def _claim_floor(self) -> SLOClassSpec:
        floor = self.claim.min_ttft_slo_ms
        if floor is not None and floor > self.ttft_slo_ms:
            raise ValueError("claim.minTtftSloMs must not exceed ttftSloMs")
        return self

    def secret_names(self) -> list[str]:
        """The Secrets this class reads API keys from (match and claim rules)."""
        refs = (self.match.api_key_secret_ref, self.claim.api_key_secret_ref)
        return sorted({ref.name for ref in refs if ref is not None})


class SLOClassStatus(CRModel):
    """Observed state of an SLO class."""

    accepted: bool | None = Field(
        default=None, description="Whether the class is in use as specified."
    )
    reason: str = Field(default="", description="Why the class is (not) accepted.")
    message: str = Field(default="", description="Details for the reason.")
    observed_generation: int | None = Field(
        default=None, description="metadata.generation the acceptance was computed for."
    )
    attainment: float | None = Field(
        default=None, description="Fraction of requests that met the TTFT target in the window."
    )
    request_count: int | None = Field(
        default=None, description="Requests of this class the gateways finished in the window."
    )
    shed_count: int | None = Field(
        default=None,
        description="Requests of this class the gateways refused at admission (HTTP 429: "
        "they could not be served before their deadline) in the window.",
    )
    window_seconds: int | None = Field(
        default=None, description="Length of the window the attainment covers."
    )
    attainment_time: str | None = Field(
        default=None,
        description="When attainment, requestCount and shedCount were last written (RFC "
        "3339): at once when the attainment moves by a percentage point or a condition "
        "changes, else at most every 5 minutes.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready (the class is in use as specified) and Degraded (attainment "
        "below spec.attainmentTarget: reason AttainmentBelowTarget).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
