"""Simulation settings (pydantic) and how they turn into a cost model and workloads."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat

from flowprefill.bench.traces import load_trace
from flowprefill.bench.workload import Workload, get_slo_table, qwen_like, sharegpt_like
from flowprefill.contracts.engine import (
    DEFAULT_MAX_BLOCKING_MS,
    DEFAULT_MAX_BLOCKING_MS_CPU,
    OFF,
)
from flowprefill.errors import InvalidRequestError
from flowprefill.lab.sim.cost import (
    ATTN_EFFICIENCY,
    PASS_OVERHEAD_S,
    TP_CHECK_S,
    CostModel,
    build_cost_model,
)
from flowprefill.lab.sim.driver import LIVE_PROGRESS
from flowprefill.lab.sim.handoff import (
    DEFAULT_TRANSPORT,
    SecondTokenModel,
    build_second_token,
    get_transport,
)
from flowprefill.lab.sim.hardware import get_gpu, get_model
from flowprefill.lab.sim.profile import ProfileCostModel
from flowprefill.lab.sim.split import CPU_PIECE_OVERHEAD_S, GPU_PIECE_OVERHEAD_S, TilePlan
from flowprefill.lab.sim.systems import DEFAULT_SYSTEMS, fit_predictor, get_system
from flowprefill.prefill.predictor.model import TTFTPredictor


class CostSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    model: str = Field("llama3-8b", description="Model shape (and SLO table) to simulate.")
    gpu: str = Field("a100", description="GPU: a100 (measured), a800, h100 (scaled).")
    tp: int | None = Field(None, description="Tensor-parallel degree; default per model.")
    attn_efficiency: float = Field(ATTN_EFFICIENCY, description="Attention FLOP efficiency.")
    pass_overhead_s: float = Field(PASS_OVERHEAD_S, description="Fixed cost per pass/chunk.")
    tp_check_s: float = Field(
        TP_CHECK_S, description="With TP > 1: what each preemption checkpoint adds (rank sync)."
    )
    profile: str | None = Field(
        None, description="A `flowprefill profile` JSON: simulate that engine instead of a GPU."
    )
    profile_layers: int = Field(4, description="Layers to split a profiled pass into.")
    calibration: str | None = Field(
        None,
        description="A CSV of operator times measured on `gpu` (vidur format, optional "
        "`attention` column; docs/simulator.md): used instead of the A100 profile scaled by "
        "peak FLOP/s.",
    )
    split_overhead_s: float | None = Field(
        None,
        description="What each piece added by operator splitting costs beyond its compute; "
        "None: the model's default (10 µs on a GPU, 20 µs for a CPU profile).",
    )

    tile_plan: TilePlan = Field(
        "profiled",
        description="How split GEMMs are tiled on a GPU model: `profiled` (the engine on "
        "CUDA: the cheapest plan on the measured per-row-count times) or `equal` "
        "(ceil(t/b) equal tiles: FLOP-rate predictions only).",
    )

    def build(self) -> CostModel:
        overhead = self.split_overhead_s
        if self.profile is not None:
            return ProfileCostModel(
                load_profile(self.profile),
                num_layers=self.profile_layers,
                split_overhead_s=CPU_PIECE_OVERHEAD_S if overhead is None else overhead,
            )
        return build_cost_model(
            self.model,
            self.gpu,
            tp=self.tp,
            attn_efficiency=self.attn_efficiency,
            pass_overhead_s=self.pass_overhead_s,
            tp_check_s=self.tp_check_s,
            split_overhead_s=GPU_PIECE_OVERHEAD_S if overhead is None else overhead,
            calibration=self.calibration,
            tile_plan=self.tile_plan,
        )

    def predictor(self, cost: CostModel, max_blocking_s: float | None = None) -> TTFTPredictor:
        """The scheduler's predictor: the profile itself, or a fit to the simulated GPU
        (of an engine splitting operators at ``max_blocking_s``, when given)."""
        if self.profile is not None:
            return load_profile(self.profile)
        return fit_predictor(cost, max_blocking_s=max_blocking_s)

    def validate_names(self) -> None:
        if self.profile is not None and self.calibration is not None:
            raise InvalidRequestError(
                "--calibration (measured GPU operator times) and --profile (this engine's "
                "CPU profile) are two different cost models: give one"
            )
        if self.profile is None:
            get_model(self.model)
            get_gpu(self.gpu)
        get_slo_table(self.model)


def load_profile(path: str) -> TTFTPredictor:
    return TTFTPredictor.load(path)


class WorkloadSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: Literal["qwen", "sharegpt", "trace"] = Field(
        "qwen", description="qwen: QwenTrace-like (Table 1); sharegpt: single-SLO chat; trace."
    )
    num_requests: int = Field(2500, description="Requests per generated workload (per seed).")
    seeds: tuple[int, ...] = Field((0, 1), description="One workload per seed; results pooled.")
    arrival: Literal["poisson", "gamma"] = Field("poisson", description="Arrival process.")
    burst_cv: float = Field(2.0, description="Gamma inter-arrival CV (bursty when > 1).")
    trace: str | None = Field(None, description="Trace file (.jsonl or .csv) for kind=trace.")

    def build(self, slo_model: str, max_tokens: int) -> list[Workload]:
        if self.kind == "trace":
            if self.trace is None:
                raise InvalidRequestError("--workload trace needs --trace FILE")
            return [load_trace(Path(self.trace), get_slo_table(slo_model), max_tokens=max_tokens)]
        if self.num_requests <= 0:
            raise InvalidRequestError(f"--num-requests must be positive, got {self.num_requests}")
        if not self.seeds:
            raise InvalidRequestError("--seeds needs at least one seed")
        if self.kind == "sharegpt":
            return [sharegpt_like(self.num_requests, seed=s, model=slo_model) for s in self.seeds]
        return [
            qwen_like(
                self.num_requests,
                seed=s,
                arrival=self.arrival,
                burst_cv=self.burst_cv,
                model=slo_model,
                max_tokens=max_tokens,
            )
            for s in self.seeds
        ]


class SweepConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    cost: CostSpec = Field(default_factory=CostSpec, description="Device cost model.")
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec, description="Workload.")
    systems: tuple[str, ...] = Field(tuple(DEFAULT_SYSTEMS), description="Systems compared.")
    target: float = Field(0.9, description="SLO attainment that defines goodput.")
    rel_tol: float = Field(0.02, description="Relative precision of the bisections.")
    rates: tuple[float, ...] = Field((), description="Rate grid (req/s); empty: from bound.")
    slo_scales: tuple[float, ...] = Field(
        (0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.65, 0.8, 1.0, 1.3, 1.7, 2.2, 3.0, 4.0),
        description="SLO-scale grid for the attainment-vs-SLO curves.",
    )
    slo_rate: float | None = Field(
        None, description="Fixed rate (req/s) of the SLO-scale sweep; default 25 % of bound."
    )
    oracles: bool = Field(True, description="Also find each policy's instant-preemption oracle.")
    instances: int = Field(1, description="Prefill instances behind the gateway.")
    router: str = Field("round-robin", description="Gateway routing across instances.")
    live_progress: bool = Field(
        LIVE_PROGRESS,
        description="Refresh the running task's progress before each round, as the engine's "
        "loop does; off = the earlier engine, which refreshed it only at preemption.",
    )
    max_blocking_ms: PositiveFloat | Literal["off"] | None = Field(
        None,
        description="Run-time operator splitting, as the engine's EngineConfig.max_blocking_ms: "
        "operators predicted longer run in pieces with a checkpoint between them (systems "
        f"preempting at operator level only). null: the paper's {DEFAULT_MAX_BLOCKING_MS:g} "
        "ms on a GPU (the engine splits on a GPU only when its max_blocking_ms is set), the "
        f'engine\'s {DEFAULT_MAX_BLOCKING_MS_CPU:g} ms for a CPU --profile; "off": never '
        "split.",
    )
    jobs: int = Field(2, description="Worker processes.")
    transport: str = Field(
        DEFAULT_TRANSPORT,
        description="KV hand-off to decode (flowprefill/lab/sim/handoff.py): prices each "
        "finished request's gap to its second token, judged against its class's TBT SLO.",
    )
    kv_per_rank: bool = Field(
        False,
        description="With TP > 1: every rank sends its own KV heads (NIXL); off = today's "
        "path, gathered to rank 0 and sent as one stream.",
    )

    def second_token_model(self) -> SecondTokenModel | None:
        """The hand-off and first decode step of the simulated GPU; None for a CPU
        ``--profile`` (no GPU, no model shape to price)."""
        if self.cost.profile is not None:
            return None
        return build_second_token(
            self.cost.model,
            self.cost.gpu,
            self.transport,
            tp=self.cost.tp,
            gather_to_rank0=not self.kv_per_rank,
        )

    @property
    def max_blocking_s(self) -> float | None:
        """The bound the simulated engine splits by (seconds), or None: no splitting."""
        if self.max_blocking_ms == OFF:
            return None
        if self.max_blocking_ms is None:
            cpu = self.cost.profile is not None  # a profile is of this CPU engine
            return (DEFAULT_MAX_BLOCKING_MS_CPU if cpu else DEFAULT_MAX_BLOCKING_MS) / 1e3
        return self.max_blocking_ms / 1e3

    def check(self) -> None:
        """Reject bad values with a message naming the flag."""
        self.cost.validate_names()
        for s in self.systems:
            get_system(s)
        if not self.systems:
            raise InvalidRequestError("--systems: name at least one system")
        if not 0 < self.target < 1:
            raise InvalidRequestError(f"--target must be in (0, 1), got {self.target}")
        if not 0 < self.rel_tol < 0.5:
            raise InvalidRequestError(f"--tolerance must be in (0, 0.5), got {self.rel_tol}")
        for flag, values in (("--rates", self.rates), ("--slo-scales", self.slo_scales)):
            if any(not v > 0 for v in values):
                raise InvalidRequestError(f"{flag} must all be positive, got {list(values)}")
        if self.slo_rate is not None and not self.slo_rate > 0:
            raise InvalidRequestError(f"--slo-rate must be positive, got {self.slo_rate}")
        if self.instances < 1:
            raise InvalidRequestError(f"--instances must be ≥ 1, got {self.instances}")
        if self.jobs < 1:
            raise InvalidRequestError(f"--jobs must be ≥ 1, got {self.jobs}")
        get_transport(self.transport)  # named even where nothing is priced (--profile)
        self.second_token_model()  # --kv-per-rank over a transport that cannot do it
        if self.cost.split_overhead_s is not None and self.cost.split_overhead_s < 0:
            raise InvalidRequestError(
                f"--split-overhead-us must be ≥ 0, got {self.cost.split_overhead_s * 1e6:g}"
            )
