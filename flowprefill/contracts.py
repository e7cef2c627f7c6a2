"""Files the operator writes into ConfigMaps for the gateway (the engine reads
:class:`flowprefill.config.EngineConfig`).

These are contracts with other processes (snake_case JSON, documented in docs/operator.md):
``engine.json`` for ``flowprefill serve-prefill``, ``gateway.json`` and ``slo-table.json``
for ``flowprefill serve-gateway``. The gateway reloads the SLO table when the file changes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Contract(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Endpoint(_Contract):
    """One pool behind the gateway (a headless Service: its DNS name lists every pod)."""

    pool: str = Field(description="ServingPool name.")
    host: str = Field(description="Service DNS name.")
    port: int = Field(description="Port of the engine's HTTP server.")
    url: str = Field(description="http://host:port.")


class GatewayConfig(_Contract):
    """``/etc/flowprefill/gateway.json`` of a service's gateway."""

    version: Literal[1] = Field(default=1, description="Format version.")
    service: str = Field(description="Service name (the pools' spec.service).")
    model_name: str = Field(description="Model name clients send in `model`.")
    prefill: list[Endpoint] = Field(description="Prefill pools.")
    decode: list[Endpoint] = Field(description="Decode pools.")
    tokenizer_path: str | None = Field(
        default=None, description="Model directory holding the tokenizer; null = model_name."
    )
    max_model_len: int | None = Field(
        default=None, description="Context length; null = the model config's."
    )
    prefill_routing: Literal["slack-aware", "round-robin", "least-loaded"] = Field(
        default="slack-aware", description="How the gateway picks a prefill instance."
    )
    predictor_path: str | None = Field(
        default=None, description="TTFT profile JSON for slack-aware routing; null = linear."
    )


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
    ttft_slo_ms: int = Field(description="TTFT target in ms; deadline = arrival + this.")
    tpot_slo_ms: int | None = Field(default=None, description="TPOT target in ms, if any.")
    priority: int = Field(description="Higher is more urgent; negative = sheddable.")
    attainment_target: float = Field(description="Target fraction of requests meeting the TTFT.")
    match: SLOTableMatch = Field(default_factory=SLOTableMatch, description="Match rules.")


class SLOTable(_Contract):
    """``/etc/flowprefill/slo/slo-table.json``: classes in the order the gateway tries them.

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
