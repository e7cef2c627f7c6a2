"""``up``'s SLO scale: this machine's prefill time over the A100 reference."""

from __future__ import annotations

import pytest

from flowprefill.stack.slo import A100_PREFILL_S, machine_scale


def test_machine_scale_is_relative_to_the_a100_reference() -> None:
    assert machine_scale(10 * A100_PREFILL_S) == pytest.approx(10.0)


def test_a_machine_faster_than_the_reference_keeps_the_papers_slos() -> None:
    assert machine_scale(A100_PREFILL_S / 2) == 1.0
