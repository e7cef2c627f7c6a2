"""``gateway.json``: the configuration of one service's gateway (``flowprefill
serve-gateway``), written by the operator into a ConfigMap and by ``flowprefill up``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from flowprefill.contracts.names import Router, RouterName


class _Contract(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Endpoint(_Contract):
    """One pool behind the gateway (a headless Service: its DNS name lists every pod)."""

    pool: str = Field(description="ServingPool name.")
    host: str = Field(description="Service DNS name.")
    port: int = Field(description="Port of the engine's HTTP server.")
    url: str = Field(description="http://host:port.")

    @classmethod
    def at(cls, pool: str, host: str, port: int) -> Endpoint:
        return cls(pool=pool, host=host, port=port, url=f"http://{host}:{port}")


class HealthProbeSettings(_Contract):
    """How the gateway probes its instances' liveness to find stalled ones
    (:class:`flowprefill.gateway.routing.HealthProber`): detected within
    ``failures × (interval_s + timeout_s)``."""

    interval_s: float = Field(default=1.0, gt=0, le=60, description="Time between probes.")
    timeout_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="A probe not answered in this time failed. /health is answered by the "
        "server's event loop, never behind a prefill, so a second is generous.",
    )
    failures: int = Field(
        default=2, ge=1, le=100, description="Failed probes in a row that mark it stalled."
    )


class GatewayConfig(_Contract):
    """``gateway.json`` of a service's gateway."""

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
    prefill_routing: RouterName = Field(
        default=Router.SLACK_AWARE, description="How the gateway picks a prefill instance."
    )
    decode_routing: RouterName = Field(
        default=Router.LEAST_LOADED, description="How the gateway picks a decode instance."
    )
    predictor_path: str | None = Field(
        default=None, description="TTFT profile JSON for slack-aware routing; null = linear."
    )
    health_probe: HealthProbeSettings = Field(
        default_factory=HealthProbeSettings,
        description="Liveness probing of every instance, to route around stalled ones.",
    )
