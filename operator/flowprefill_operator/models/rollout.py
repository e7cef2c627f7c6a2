"""How a pool's pods are replaced: the Deployment's update strategy and the drain bound.

GPU pools default to ``maxSurge 0, maxUnavailable 1``: a rollout replaces a pod in place
instead of first starting one more, so it never waits for a GPU the pool does not have
(the Kubernetes default, 25 % surge, rounds up to one extra pod: on a full cluster that
pod stays Pending and the rollout never progresses). Pools without GPUs keep Kubernetes'
default surge. ``spec.rollout`` overrides either (e.g. ``maxSurge: 1`` where a spare GPU
exists and the pool must not lose capacity while it rolls).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from .common import CRModel, cel

MAX_DRAIN_SECONDS = 3600
"""Longest drain a pool may ask for (one hour: a stream longer than that is cut)."""

BOTH_ZERO = "maxSurge and maxUnavailable must not both be 0 (the rollout could never start)"
RECREATE_TAKES_NO_SURGE = "maxSurge and maxUnavailable apply to type RollingUpdate only"


class RolloutSpec(CRModel):
    """``spec.rollout``: the update strategy of the pool's Deployment and how long a pod
    that is going away may finish its in-flight requests."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.maxSurge) || !has(self.maxUnavailable)"
                    " || self.maxSurge + self.maxUnavailable > 0",
                    BOTH_ZERO,
                ),
                cel(
                    "self.type == 'RollingUpdate'"
                    " || (!has(self.maxSurge) && !has(self.maxUnavailable))",
                    RECREATE_TAKES_NO_SURGE,
                ),
            ]
        }
    )

    type: Literal["RollingUpdate", "Recreate"] = Field(
        default="RollingUpdate",
        description="RollingUpdate (pods replaced a few at a time) or Recreate (all old pods "
        "stop before new ones start).",
    )
    max_surge: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description="Pods above replicas a rolling update may start; unset: 0 on a pool "
        "with GPUs (a rollout needs no spare GPU), Kubernetes' 25% otherwise.",
    )
    max_unavailable: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description="Pods below replicas a rolling update may stop; unset: 1 on a pool "
        "with GPUs, Kubernetes' 25% otherwise. With maxSurge 0 it must be at least 1.",
    )
    drain_seconds: int | None = Field(
        default=None,
        ge=0,
        le=MAX_DRAIN_SECONDS,
        description="How long a terminating pod may finish its in-flight requests after it "
        "stopped taking new ones (decode: vLLM's --shutdown-timeout; prefill: the server's "
        "--drain-timeout); unset: the role's default (docs/pods.md). The grace period "
        "is sized from it.",
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> RolloutSpec:
        surge, unavailable = self.max_surge, self.max_unavailable
        if surge is not None and unavailable is not None and surge + unavailable == 0:
            raise ValueError(BOTH_ZERO)
        if self.type == "Recreate" and (surge is not None or unavailable is not None):
            raise ValueError(RECREATE_TAKES_NO_SURGE)
        return self
