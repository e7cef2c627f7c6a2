"""Gateway metrics -> per-class SLO attainment over a recent window (SLOClass status).

The gateways export cumulative counters ``flowprefill_gateway_slo_requests_total{slo_class,
outcome="met"|"missed"}``. The operator scrapes every gateway pod of a namespace
periodically, keeps the samples of the last window, and reports the increase over that
window: attainment = met / (met + missed). Counter resets (pod restarts) are handled like
Prometheus' ``increase()``. The first scrape of a pod is only a baseline, so totals from
before the operator started are not mistaken for recent traffic; a pod first seen later
(a new gateway replica) counts from zero.
"""

from __future__ import annotations

import itertools
import threading
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from flowprefill.contracts.metrics import (
    GATEWAY_SLO_REQUESTS,
    OUTCOME_LABEL,
    SLO_CLASS_LABEL,
    Outcome,
)

SLO_REQUESTS = GATEWAY_SLO_REQUESTS
OUTCOMES = (Outcome.MET.value, Outcome.MISSED.value)

# pod -> class -> outcome -> cumulative count
Sample = dict[str, dict[str, dict[str, float]]]


@dataclass(frozen=True)
class Attainment:
    met: float
    missed: float
    window_s: float

    @property
    def requests(self) -> int:
        return round(self.met + self.missed)

    @property
    def fraction(self) -> float | None:
        total = self.met + self.missed
        return self.met / total if total > 0 else None


def parse_slo_counters(text: str) -> dict[str, dict[str, float]]:
    """class -> outcome -> cumulative count, from one gateway's /metrics text."""
    counts: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (SLO_REQUESTS, SLO_REQUESTS + "_total"):
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # _created
            cls, outcome = sample.labels.get(SLO_CLASS_LABEL), sample.labels.get(OUTCOME_LABEL)
            if cls and outcome in OUTCOMES:
                per_class = counts.setdefault(cls, {})
                per_class[outcome] = per_class.get(outcome, 0.0) + sample.value
    return counts


def _increase(values: list[float]) -> float:
    total = 0.0
    for before, after in itertools.pairwise(values):
        total += after - before if after >= before else after  # reset: counted from zero
    return total


class AttainmentTracker:
    """Samples per namespace over the window; thread-safe (kopf timers run in threads)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._samples: dict[str, deque[tuple[float, Sample]]] = {}

    def record(self, namespace: str, t: float, sample: Sample) -> None:
        with self._lock:
            samples = self._samples.setdefault(namespace, deque())
            samples.append((t, sample))
            # Keep one sample at or before the window start as the baseline.
            while len(samples) > 2 and samples[1][0] <= t - self.window_s:
                samples.popleft()

    def last_time(self, namespace: str) -> float | None:
        with self._lock:
            samples = self._samples.get(namespace)
            return samples[-1][0] if samples else None

    def sample_count(self, namespace: str) -> int:
        with self._lock:
            return len(self._samples.get(namespace, ()))

    def window(self, namespace: str) -> dict[str, Attainment]:
        """class -> attainment over the kept samples; empty until there are two."""
        with self._lock:
            samples = list(self._samples.get(namespace, ()))
        if len(samples) < 2:
            return {}
        span = samples[-1][0] - samples[0][0]
        pods = {pod for _, sample in samples for pod in sample}
        baseline_pods = set(samples[0][1])
        totals: dict[str, dict[str, float]] = {}
        for pod in pods:
            classes = {c for _, s in samples for c in s.get(pod, {})}
            for cls in classes:
                for outcome in OUTCOMES:
                    # A class a pod had not served yet counts from zero.
                    series = [s[pod].get(cls, {}).get(outcome, 0.0) for _, s in samples if pod in s]
                    if pod not in baseline_pods:
                        series = [0.0, *series]  # appeared in the window: started from zero
                    per_class = totals.setdefault(cls, {})
                    per_class[outcome] = per_class.get(outcome, 0.0) + _increase(series)
        return {
            cls: Attainment(met=v.get("met", 0.0), missed=v.get("missed", 0.0), window_s=span)
            for cls, v in totals.items()
        }


def fetch_text(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        body: bytes = resp.read()
    return body.decode()


def scrape(
    targets: Mapping[str, str], fetch: Callable[[str], str]
) -> tuple[Sample, dict[str, str]]:
    """Scrape pod -> URL; returns the sample and the errors (pod -> message)."""
    sample: Sample = {}
    errors: dict[str, str] = {}
    for pod, url in targets.items():
        try:
            sample[pod] = parse_slo_counters(fetch(url))
        except Exception as e:  # one bad gateway must not hide the others
            errors[pod] = f"{type(e).__name__}: {e}"
    return sample, errors
