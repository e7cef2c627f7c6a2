"""An instance's back-off after failures stays bounded however many failures pile up:
a stalled instance abandons every stream in flight on it at once, thousands at scale, and
each counts a failure (benchmarks/gateway/streams.py met this at 5,000 open streams)."""

from __future__ import annotations

from flowprefill.gateway.routing import InstancePool


def test_thousands_of_failures_back_off_for_the_maximum() -> None:
    now = [100.0]
    pool = InstancePool("decode", ["http://d"], clock=lambda: now[0], max_backoff_s=30.0)
    inst = pool.instances[0]
    for _ in range(5000):  # 2.0 ** 1024 overflowed a float here
        pool.mark_failure(inst)
    assert not inst.healthy and inst.retry_after_s == 130.0
