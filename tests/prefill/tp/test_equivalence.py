"""TP=2 (two gloo ranks) computes what TP=1 computes, preempted or not.

Tolerance: float32 throughout; the row-parallel projections sum their partial products on
two ranks and all-reduce them, a different summation order from one GEMM, so logits and
every KV tensor agree with TP=1 within ``ATOL`` (measured: at most 1e-6 on the tiny
models) and the first token is the same unless the top two logits are closer than that.
A preempted-and-resumed TP prefill is bit-identical to an uninterrupted TP prefill.
"""

from __future__ import annotations

import torch

from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor, PrefillOutput
from flowprefill.prefill.tp.prefill_backend import TPPrefillBackend
from tests.prefill.tp.harness import Task, assert_same, prompts, ranks_agree

ATOL = 1e-5


def assert_close_to_tp1(tp: list[PrefillOutput], ref: list[PrefillOutput]) -> None:
    for x, y in zip(tp, ref, strict=True):
        assert x.num_prompt_tokens == y.num_prompt_tokens
        top2 = torch.topk(y.logits, 2).values
        if float(top2[0] - top2[1]) > ATOL:
            assert x.first_token_id == y.first_token_id
        torch.testing.assert_close(x.logits, y.logits, atol=ATOL, rtol=0)
        assert len(x.kv_cache) == len(y.kv_cache)
        for (k1, v1), (k2, v2) in zip(x.kv_cache, y.kv_cache, strict=True):
            assert k1.shape == k2.shape  # every KV head reached rank 0
            torch.testing.assert_close(k1, k2, atol=ATOL, rtol=0)
            torch.testing.assert_close(v1, v2, atol=ATOL, rtol=0)


def test_tp2_first_token_and_kv_equal_tp1(tp2: TPPrefillBackend, tp1: PreemptibleExecutor) -> None:
    batch = prompts([97, 31, 260], tp2.vocab_size, seed=1)
    out = tp2.run(batch, TaskControl("tp2"))
    assert_close_to_tp1(out, tp1.run(batch, TaskControl("tp1")))


def test_nested_preemptions_are_bit_identical_and_ranks_park_together(
    tp2: TPPrefillBackend, tp1: PreemptibleExecutor
) -> None:
    """A is preempted by B, B by C; C finishes, B resumes and finishes, A resumes, is
    preempted again and finishes. Outputs equal the solo TP runs bit for bit, and every
    rank parked each task at the same checkpoint numbers."""
    vocab = tp2.vocab_size
    pa, pb, pc = (prompts(n, vocab, seed=s) for n, s in (([300, 41], 2), ([220], 3), ([17], 4)))
    solo = {
        name: tp2.run(p, TaskControl(f"solo-{name}"))
        for name, p in zip("abc", (pa, pb, pc), strict=True)
    }

    a = Task(tp2, pa, "A").start()
    a.wait_checkpoints(3)
    assert a.preempt()
    b = Task(tp2, pb, "B").start()
    b.wait_checkpoints(7)
    assert b.preempt()
    c = Task(tp2, pc, "C").start()
    out_c = c.join()
    b.control.resume()
    out_b = b.join()
    a.control.resume()
    a.wait_checkpoints(a.control.num_checkpoints + 2)
    second = a.preempt()
    if second:
        a.control.resume()
    out_a = a.join()

    assert out_a is not None and out_b is not None and out_c is not None
    assert_same(out_a, solo["a"])
    assert_same(out_b, solo["b"])
    assert_same(out_c, solo["c"])
    assert_close_to_tp1(out_a, tp1.run(pa, TaskControl("ref-a")))
    parked = ranks_agree(tp2)
    assert sum(len(v) for v in parked.values()) >= 2 + int(second)
