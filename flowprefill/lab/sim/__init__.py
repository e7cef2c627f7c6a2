"""Goodput simulator: the engine's scheduler against a simulated execution pool.

``flowprefill simulate`` (see :mod:`flowprefill.lab.sim.cli` and docs/simulator.md) compares
FlowPrefill with DistServe-like baselines on a GPU cost model built from measured
operator times, or on this engine's own profile.
"""

from flowprefill.bench.workload import Workload, qwen_like, sharegpt_like
from flowprefill.contracts.names import Granularity
from flowprefill.lab.sim.cost import CostModel, GPUCostModel, build_cost_model
from flowprefill.lab.sim.driver import Instance, SimResult, Simulation
from flowprefill.lab.sim.plan import ExecutionPlan
from flowprefill.lab.sim.pool import SimulatedPool
from flowprefill.lab.sim.profile import ProfileCostModel
from flowprefill.lab.sim.systems import SYSTEMS, SystemSpec, get_system, run_system

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
