"""The A100 reference ``flowprefill up`` scales its SLOs by is the simulator's number."""

from __future__ import annotations

import pytest

from flowprefill.lab.sim.cost import build_cost_model
from flowprefill.stack.slo import A100_PREFILL_S, SCALE_AT_TOKENS


def test_up_reference_is_the_cost_models_ideal_a100_prefill() -> None:
    computed = build_cost_model("llama3-8b", "a100").ideal_cost_s(SCALE_AT_TOKENS)
    assert pytest.approx(computed, rel=1e-4) == A100_PREFILL_S
