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
    (:class:`flowprefill.gateway.health.HealthProber`): detected within
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


class OverloadSettings(_Contract):
    """How the gateway bounds what waits under overload (docs/gateway.md, "Overload";
    :mod:`flowprefill.gateway.admission`). A request of a class that is not sheddable is
    answered 503 with ``Retry-After`` instead of waiting when its first token is predicted
    later than its deadline plus its *useful wait*, ``max(useful_wait_factor × TTFT
    target, useful_wait_floor_s)``, or is still not there by then; and any request is
    answered 503 when ``max_waiting`` requests already wait for their first token."""

    useful_wait_factor: float = Field(
        default=1.0,
        ge=0,
        le=1000,
        description="How late past its deadline, in TTFT targets, a non-sheddable request's "
        "first token is still worth waiting for (1: served by twice its target at worst).",
    )
    useful_wait_floor_s: float = Field(
        default=1.0,
        ge=0,
        le=3600,
        description="The least useful wait in seconds, so a tight target is not refused on "
        "a prediction error or a short burst.",
    )
    max_waiting: int = Field(
        default=10_000,
        ge=1,
        description="Requests waiting for their first token at this gateway, at most: the "
        "hard bound on its queue and the memory it holds.",
    )

    def useful_wait_s(self, ttft_slo_s: float) -> float:
        """How long past the deadline of a request with this TTFT target it may wait."""
        return max(self.useful_wait_factor * ttft_slo_s, self.useful_wait_floor_s)


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
    overload: OverloadSettings = Field(
        default_factory=OverloadSettings,
        description="Bounds on what waits under overload: the useful wait and the queue.",
    )
