"""ServingPool autoscaling: who owns ``spec.replicas``, the autoscaler's knobs (mapped onto
:class:`flowprefill.autoscale.policy.ScalerSettings`) and what it reports in status."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from .common import CRModel, cel

ReplicasOwner = Literal["external", "operator"]

MAX_WINDOW_SECONDS = 21_600
"""Longest window the autoscaler reads (6 h): the operator keeps the gateways' samples
that long in memory, one per scrape interval."""

MIN_REPLICAS_ABOVE_MAX = "minReplicas must not exceed maxReplicas"
SHORT_WINDOW_NOT_SHORTER = "shortWindowSeconds must be shorter than longWindowSeconds"
DOWN_RATE_NOT_LOWER = "scaleDownBurnRate must be lower than scaleUpBurnRate (hysteresis)"
TPOT_DOWN_NOT_LOWER = "tpotDownRatio must be lower than tpotUpRatio (hysteresis)"
OPERATOR_NEEDS_AUTOSCALING = "replicasOwner operator needs an autoscaling block"


class Autoscaling(CRModel):
    """How the operator sizes the pool when it owns the replicas (``replicasOwner:
    operator``). Prefill pools follow the SLO attainment of every class the service serves
    (the class burning its error budget fastest drives: burn rate = miss fraction /
    (1 - attainmentTarget), over a short and a long window); decode pools follow the p90
    time per output token against the classes' ``tpotSloMs``. Defaults are the policy's
    (:class:`flowprefill.autoscale.policy.ScalerSettings`)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.minReplicas <= self.maxReplicas", MIN_REPLICAS_ABOVE_MAX),
                cel("self.shortWindowSeconds < self.longWindowSeconds", SHORT_WINDOW_NOT_SHORTER),
                cel("self.scaleDownBurnRate < self.scaleUpBurnRate", DOWN_RATE_NOT_LOWER),
                cel("self.tpotDownRatio < self.tpotUpRatio", TPOT_DOWN_NOT_LOWER),
            ]
        }
    )

    min_replicas: int = Field(default=1, ge=0, le=1024, description="Fewest pods it keeps.")
    max_replicas: int = Field(ge=1, le=1024, description="Most pods it asks for.")
    short_window_seconds: int = Field(
        default=300,
        ge=30,
        le=MAX_WINDOW_SECONDS,
        description="Short window of the burn rate (reacts fast; also used for TPOT p90).",
    )
    long_window_seconds: int = Field(
        default=3600,
        ge=60,
        le=MAX_WINDOW_SECONDS,
        description="Long window of the burn rate (confirms the short one is not a blip).",
    )
    scale_up_burn_rate: float = Field(
        default=2.0,
        gt=0,
        le=1000,
        description="Prefill: scale up when the class burning its error budget fastest "
        "burns at least this fast in both windows (burn rate = missed fraction / (1 - "
        "attainmentTarget); 1 = spending it exactly as fast as allowed).",
    )
    scale_down_burn_rate: float = Field(
        default=0.5,
        ge=0,
        le=1000,
        description="Prefill: scale down when every class burns at most this in both windows "
        "(must be lower than scaleUpBurnRate: the band between is hysteresis).",
    )
    tpot_up_ratio: float = Field(
        default=1.0,
        gt=0,
        le=100,
        description="Decode: scale up when p90 time per output token exceeds this x the "
        "tightest tpotSloMs in both windows.",
    )
    tpot_down_ratio: float = Field(
        default=0.6,
        ge=0,
        le=100,
        description="Decode: scale down when p90 TPOT is under this x the target in both "
        "windows (must be lower than tpotUpRatio).",
    )
    scale_up_cooldown_seconds: int = Field(
        default=60, ge=0, le=86_400, description="Least time between two scale-ups."
    )
    scale_down_cooldown_seconds: int = Field(
        default=600,
        ge=0,
        le=86_400,
        description="Least time after any scale change before a scale-down.",
    )
    warmup_seconds: int = Field(
        default=120,
        ge=0,
        le=3600,
        description="Start-up time of a new pod (weights, warm-up): pods not ready yet and "
        "younger than this count as coming capacity, not as missing capacity.",
    )
    max_step_up: int = Field(
        default=4, ge=1, le=1024, description="Most pods added in one decision."
    )
    min_requests: int = Field(
        default=20,
        ge=0,
        le=1_000_000,
        description="Requests of a class the long window needs before its burn rate can "
        "scale up (and of all classes together before the pool can scale down).",
    )
    min_short_requests: int = Field(
        default=5,
        ge=0,
        le=1_000_000,
        description="Requests of a class the short window needs before its burn rate can scale up.",
    )
    gpu_budget: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="GPUs the service's pools may hold together (replicas x gpusPerPod of "
        "every pool of spec.service); the smallest budget set on any of them applies. "
        "Unset = no budget.",
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(MIN_REPLICAS_ABOVE_MAX)
        if self.short_window_seconds >= self.long_window_seconds:
            raise ValueError(SHORT_WINDOW_NOT_SHORTER)
        if self.scale_down_burn_rate >= self.scale_up_burn_rate:
            raise ValueError(DOWN_RATE_NOT_LOWER)
        if self.tpot_down_ratio >= self.tpot_up_ratio:
            raise ValueError(TPOT_DOWN_NOT_LOWER)
        return self


HISTORY_MAX_POINTS = 64
"""Bound of ``status.autoscaler.history`` (the operator writes at most 62 points)."""


class AutoscalerHistory(CRModel):
    """The service's gateway counters over the pool's long window, as the autoscaler's
    windows read them (``flowprefill_operator.history``): kept here so that a restarted
    operator, or a standby taking over, resumes the windows instead of starting them
    again. Written by the autoscaler only, at most once per 1/60 of the long window."""

    times: list[float] = Field(
        default_factory=list,
        max_length=HISTORY_MAX_POINTS,
        description="Times of the points (Unix seconds), oldest first; the last is the cursor's.",
    )
    counts: dict[str, dict[str, list[float]]] = Field(
        default_factory=dict,
        description="SLO class -> series (met, missed, prefill_work_s, tpot_le_<bound>) -> "
        "its increase from each point to the next (one fewer than times); series that did "
        "not move are left out.",
    )
    cursor: dict[str, dict[str, dict[str, float]]] = Field(
        default_factory=dict,
        description="Gateway pod -> SLO class -> series -> its counter at the last point: "
        "the next scrape's increase is taken from here.",
    )


class AutoscalerStatus(CRModel):
    """What the autoscaler last decided and when it last changed the replicas (its
    cool-down memory), and the history its windows read: kept here so that a restarted
    operator, or a standby taking over, resumes both."""

    desired_replicas: int | None = Field(
        default=None, description="Replicas of the last decision (within the GPU budget)."
    )
    reason: str = Field(default="", description="Why the last decision was made.")
    driver: str = Field(
        default="", description="The SLO class (or signal) that drove the last decision."
    )
    last_scale_up_time: str | None = Field(
        default=None, description="When the autoscaler last added pods (RFC 3339)."
    )
    last_scale_down_time: str | None = Field(
        default=None, description="When the autoscaler last removed pods (RFC 3339)."
    )
    history: AutoscalerHistory | None = Field(
        default=None,
        description="The windows' history (see AutoscalerHistory); absent until the "
        "autoscaler has scraped the service's gateways.",
    )
