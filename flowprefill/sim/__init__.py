"""Goodput simulator: the engine's scheduler against a simulated execution pool.

``flowprefill simulate`` (see :mod:`flowprefill.sim.cli` and docs/simulator.md) compares
FlowPrefill with DistServe-like baselines on a GPU cost model built from measured
operator times, or on this engine's own profile.
"""

from flowprefill.sim.cost import CostModel, GPUCostModel, build_cost_model
from flowprefill.sim.driver import Instance, SimResult, Simulation
from flowprefill.sim.plan import ExecutionPlan, Granularity
from flowprefill.sim.pool import SimulatedPool
from flowprefill.sim.profile import ProfileCostModel
from flowprefill.sim.systems import SYSTEMS, SystemSpec, get_system, run_system
from flowprefill.sim.workload import Workload, qwen_like, sharegpt_like

__all__ = [
    "SYSTEMS",
    "CostModel",
    "ExecutionPlan",
    "GPUCostModel",
    "Granularity",
    "Instance",
    "ProfileCostModel",
    "SimResult",
    "SimulatedPool",
    "Simulation",
    "SystemSpec",
    "Workload",
    "build_cost_model",
    "get_system",
    "qwen_like",
    "run_system",
    "sharegpt_like",
]
