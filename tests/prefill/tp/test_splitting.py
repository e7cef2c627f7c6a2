"""Operator splitting under tensor parallelism: every rank splits alike and parks together.

Ranks predict with rank 0's measured rates (broadcast at start), so the split plan — and
with it every checkpoint number — is the same on every rank even when they measured
different speeds. A tight bound splits every operator of these prompts.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.factory import build_executor
from flowprefill.prefill.tp.prefill_backend import TPPrefillBackend
from tests.prefill.tp.conftest import tp_config
from tests.prefill.tp.harness import Task, assert_same, prompts, ranks_agree
from tests.prefill.tp.test_equivalence import assert_close_to_tp1

TIGHT_MS = 0.0005  # 0.5 µs: every operator of these prompts splits at any measured speed


@pytest.fixture(scope="module", params=["llama", "qwen3-moe"])
def split_tp2(request: pytest.FixtureRequest) -> Iterator[TPPrefillBackend]:
    backend = TPPrefillBackend(tp_config(str(request.param), max_blocking_ms=TIGHT_MS))
    yield backend
    backend.close()


def test_split_tp2_equals_unsplit_tp1_and_ranks_park_together(split_tp2: TPPrefillBackend) -> None:
    family = split_tp2.config.model_path.removeprefix("tiny-")
    vocab = split_tp2.vocab_size
    pa, pb = prompts([260, 40], vocab, seed=7), prompts([150], vocab, seed=8)
    solo_a = split_tp2.run(pa, TaskControl("solo-a"))
    with build_executor(tp_config(family, tp_size=1, max_blocking_ms="off")) as tp1:
        assert_close_to_tp1(solo_a, tp1.run(pa, TaskControl("ref")))
        whole_checks = tp1.expected_checkpoints([260, 40])

    a = Task(split_tp2, pa, "A").start()
    a.wait_checkpoints(2 * whole_checks)  # deep inside split operators
    assert a.preempt()
    b = Task(split_tp2, pb, "B").start()
    b.wait_checkpoints(11)
    assert b.preempt()
    b.control.resume()
    out_b = b.join()
    a.control.resume()
    out_a = a.join()
    assert out_a is not None and out_b is not None
    assert_same(out_a, solo_a)
    assert_same(out_b, split_tp2.run(pb, TaskControl("solo-b")))
    assert a.control.num_checkpoints > 2 * whole_checks  # it really split
    parked = ranks_agree(split_tp2)
    assert sum(len(v) for v in parked.values()) >= 2
