"""The engine with the real model executor: preemption changes timing, never results."""

from __future__ import annotations

import time

import pytest
import torch

from flowprefill.models import build_named
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.predictor.model import TTFTPredictor


@pytest.mark.parametrize("granularity", ["operator", "layer"])
def test_preempted_long_prefill_is_bit_identical_and_urgent_one_jumps_ahead(
    granularity: str,
) -> None:
    model = build_named("tiny-llama", seed=1)
    gen = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(0, 2000, (6000,), generator=gen).tolist()
    short_prompts = [torch.randint(0, 2000, (n,), generator=gen).tolist() for n in (40, 90)]
    with PreemptibleExecutor(model, granularity=granularity) as ex:
        solo = ex.prefill([long_prompt])[0]
        solo_short = [ex.prefill([p])[0] for p in short_prompts]
        t0 = time.perf_counter()
        ex.prefill([long_prompt])
        long_s = time.perf_counter() - t0
        predictor = TTFTPredictor.linear(per_token_s=long_s / 6000)
        with PrefillEngine(ex, predictor, batching="none") as eng:
            long_f = eng.submit(long_prompt, ttft_slo_s=100 * long_s, slo_class="file")
            time.sleep(long_s / 5)
            short_fs = [
                eng.submit(p, ttft_slo_s=10 * long_s, slo_class="chat") for p in short_prompts
            ]
            # Tighter deadlines than the long one's: each short request must preempt it.
            shorts = [f.result(timeout=60) for f in short_fs]
            long = long_f.result(timeout=60)
    assert long.num_preemptions >= 1
    assert eng.blocking_times_s and max(eng.blocking_times_s) < long_s
    assert all(s.finish_s < long.finish_s for s in shorts)
    out = long.output
    assert out.first_token_id == solo.first_token_id
    assert torch.equal(out.logits, solo.logits)
    for (k, v), (k2, v2) in zip(out.kv_cache, solo.kv_cache, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    for s, alone in zip(shorts, solo_short, strict=True):
        assert s.output.first_token_id == alone.first_token_id
        assert torch.allclose(s.output.logits, alone.logits, atol=1e-5)
