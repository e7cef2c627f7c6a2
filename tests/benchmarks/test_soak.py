"""benchmarks/soak/soak.py: the growth verdict on synthetic series, the reconciliation of the
gateway's counters (its own metrics class) with a client's outcomes, and one tiny real
soak of a prefill-only ``flowprefill up``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

from benchmarks.soak import counts, trend
from flowprefill.bench.client import Outcome
from flowprefill.gateway.errors import ShedError, UpstreamError
from flowprefill.gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("dof", "exact"), [(4, 2.776), (6, 2.447), (10, 2.228), (30, 2.042), (100, 1.984)]
)
def test_t_quantile_matches_the_table(dof: int, exact: float) -> None:
    assert trend.t_quantile(0.975, dof) == pytest.approx(exact, rel=3e-3)


def _minutes(n: int, every_s: float = 5.0) -> list[float]:
    return [i * every_s for i in range(n)]


def test_a_steady_leak_is_growth_with_its_slope() -> None:
    rng = np.random.default_rng(0)
    t = _minutes(96)  # 8 minutes
    rss = [500 + 3.0 * s / 60 + rng.normal(0, 2) for s in t]
    tr = trend.fit_trend(t, rss)
    assert tr.num_samples == 96
    assert tr.window_min == pytest.approx(95 * 5 / 60)
    assert abs(tr.slope_per_min - 3.0) < tr.ci_per_min < 1.0
    assert tr.verdict(10.0) == "growth"
    # The same slope, but a window too short for it to add up to the threshold.
    assert tr.verdict(100.0) == "steady"


def test_noise_and_a_step_are_not_growth() -> None:
    rng = np.random.default_rng(1)
    t = _minutes(96)
    flat = [500 + rng.normal(0, 5) for _ in t]
    assert trend.fit_trend(t, flat).verdict(10.0) == "steady"
    # Settles 2 MB higher half-way: a "significant" slope, but not a change that counts.
    step = [500.0 + (2.0 if i >= 48 else 0.0) for i in range(96)]
    tr = trend.fit_trend(t, step)
    assert tr.slope_per_min - tr.ci_per_min > 0
    assert tr.verdict(10.0) == "steady"
    constant = [17.0] * 96
    tr = trend.fit_trend(t, constant)
    assert (tr.slope_per_min, tr.ci_per_min, tr.verdict(5.0)) == (0.0, 0.0, "steady")


def test_falling_and_too_few_samples() -> None:
    t = _minutes(60)
    assert trend.fit_trend(t, [40 - 2.0 * s / 60 for s in t]).verdict(5.0) == "falling"
    assert trend.fit_trend(t[:3], [1.0, 50.0, 100.0]).verdict(5.0) == "too few samples"
    assert trend.fit_trend([0.0], [1.0]).verdict(5.0) == "too few samples"
    with pytest.raises(ValueError, match="2 times but 1 values"):
        trend.fit_trend([0.0, 1.0], [1.0])


def _outcome(cls: str, *, ttft_s: float | None, error: str | None = None) -> Outcome:
    return Outcome("r", cls, 100, 0.5, 0.0, ttft_s=ttft_s, error=error)


def _page(m: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return counts.parse_page(generate_latest(m.registry).decode())


def test_the_gateways_counters_reconcile_with_the_clients() -> None:
    m = GatewayMetrics()
    m.first_token("text", ttft_s=0.1, met=True, wait_s=0.1)  # before the load
    m.failed(ShedError("batch", ttft_slo_s=1, best_finish_in_s=2, retry_after_s=1))
    before = _page(m)
    m.first_token("text", ttft_s=0.1, met=True, wait_s=0.1)
    m.first_token("text", ttft_s=0.9, met=False, wait_s=0.8)
    m.first_token("search", ttft_s=1.0, met=True, wait_s=0.9)
    # A decode stream that broke after the first token: counted in both.
    m.first_token("search", ttft_s=1.0, met=True, wait_s=0.9)
    m.failed(UpstreamError(502, "decode gone", "decode_connection"))
    m.failed(UpstreamError(503, "prefill gone", "prefill_connection"))
    after = _page(m)
    client = counts.client_counts(
        [
            _outcome("text", ttft_s=0.1),
            _outcome("text", ttft_s=0.9),
            _outcome("search", ttft_s=1.0),
            _outcome("search", ttft_s=1.0, error="decode gone"),
            _outcome("search", ttft_s=None, error="prefill gone"),
        ]
    )
    assert (client["search"].sent, client["search"].first_token, client["search"].errors) == (
        3,
        2,
        2,
    )
    gateway = counts.gateway_counts(before, after)
    assert gateway.first_token == {"text": 2, "search": 2}
    assert gateway.met == {"text": 1, "search": 2}
    assert gateway.errors == {"decode_connection": 1, "prefill_connection": 1}
    rows = counts.reconcile(client, gateway)
    assert not [r for r in rows if r.mismatch]
    assert {r.what: (r.client, r.gateway) for r in rows}["errors (all classes)"] == (2, 2)


def test_every_kind_of_disagreement_is_a_mismatch() -> None:
    m = GatewayMetrics()
    before = _page(m)
    m.first_token("text", ttft_s=0.1, met=True, wait_s=0.1)
    m.first_token("image", ttft_s=0.1, met=True, wait_s=0.1)  # the client never saw it
    m.failed(UpstreamError(502, "x", "prefill_status"))
    m.claims_refused.labels("text", "class").inc()
    after = _page(m)
    client = counts.client_counts([_outcome("text", ttft_s=0.1), _outcome("file", ttft_s=0.2)])
    rows = counts.reconcile(client, counts.gateway_counts(before, after))
    bad = {r.what: (r.client, r.gateway) for r in rows if r.mismatch}
    assert bad == {
        "image: first tokens": (0, 1),
        "file: first tokens": (1, 0),
        "errors (all classes)": (0, 1),
        "claims refused": (0, 1),
    }


def test_a_tiny_soak_of_a_prefill_only_stack(tmp_path: Path) -> None:
    """``up --decode 0`` with the tiny model: the output's structure, and not one request
    the gateway and the client count differently."""
    pytest.importorskip("psutil")
    from flowprefill.prefill.predictor.model import TTFTPredictor

    profile = tmp_path / "p.json"
    TTFTPredictor.linear(2e-5).save(profile)
    out = tmp_path / "soak"
    env = {
        **os.environ,
        "FLOWPREFILL_MODEL_CACHE": str(tmp_path / "models"),
        "OMP_NUM_THREADS": "1",
    }
    argv = [
        sys.executable, str(ROOT / "benchmarks" / "soak" / "soak.py"), "--rate", "8",
        "--minutes", "0.3", "--warmup", "0.1", "--sample-s", "1", "--model", "tiny-llama",
        "--length-scale", "0.02", "--decode", "0", "--profile", str(profile),
        "--allow-growth", "--out", str(out),
    ]  # fmt: skip
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and summary["failures"] == []
    assert summary["load"]["requests"] > 0 and summary["load"]["errors"] == 0
    recon = summary["reconciliation"]
    assert not [r for r in recon if r["mismatch"]]
    first = sum(r["gateway"] for r in recon if r["what"].endswith(": first tokens"))
    assert first == summary["load"]["requests"]
    roles = {p["role"] for p in summary["processes"]}
    assert {"up-supervisor", "gateway", "prefill"} <= roles
    for p in summary["processes"]:
        for resource in ("rss_mb", "fds"):
            assert p[resource]["verdict"] in ("growth", "steady", "falling", "too few samples")
            assert p[resource]["num_samples"] >= 6
    assert all(len(s["t_s"]) == len(s["rss_mb"]) == len(s["fds"]) > 6 for s in summary["series"])
    assert all("serve-prefill" in s["cmdline"] for s in summary["series"] if s["role"] == "prefill")
    assert set(summary["gauges"]) == {
        "in flight at the gateway",
        "queued at prefill 0",
        "parked MB at prefill 0",
    }
    assert all(len(points) > 6 for points in summary["gauges"].values())
    assert (out / "soak.png").stat().st_size > 10_000
    assert "per process from 0.1 min (warm-up) to 0.3 min" in run.stdout
    assert "MISMATCH" not in run.stdout
