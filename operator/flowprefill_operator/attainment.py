"""Gateway metrics -> per-class counts over recent windows (SLOClass status, autoscaler).

The gateways export cumulative counters ``flowprefill_gateway_slo_requests_total{slo_class,
outcome="met"|"missed"}``, ``flowprefill_gateway_shed_total{slo_class}`` and the histogram
``flowprefill_gateway_tpot_seconds{slo_class}``. The operator scrapes every gateway pod of a
namespace periodically, keeps the samples of the longest window anyone asked for, and
reports the increase over a window: attainment = met / (met + missed) for SLOClass status
and the autoscaler's short and long windows, p90 TPOT from the histogram's buckets.
Counter resets (pod restarts) are handled like Prometheus' ``increase()``. The first scrape
of a pod is only a baseline, so totals from before the operator started are not mistaken
for recent traffic; a pod first seen later (a new gateway replica) counts from zero.
"""

from __future__ import annotations

import itertools
import math
import threading
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from flowprefill.contracts.metrics import (
    GATEWAY_PREFILL_WORK,
    GATEWAY_SHED,
    GATEWAY_SLO_REQUESTS,
    GATEWAY_TPOT,
    OUTCOME_LABEL,
    SLO_CLASS_LABEL,
    Outcome,
)

SLO_REQUESTS = GATEWAY_SLO_REQUESTS
OUTCOMES = (Outcome.MET.value, Outcome.MISSED.value)
SHED = "shed"
WORK = "prefill_work_s"
"""Predicted device-seconds of prefill the class's requests took (the load signal)."""
TPOT_BUCKET = "tpot_le_"
"""Series of one class are named by outcome (met, missed), ``shed``, and ``tpot_le_<bound>``
for the TPOT histogram's cumulative buckets (``tpot_le_+Inf`` counts every sample)."""

# pod -> class -> series -> cumulative count
Sample = dict[str, dict[str, dict[str, float]]]
Counts = dict[str, dict[str, float]]  # class -> series -> increase over a window


@dataclass(frozen=True)
class Attainment:
    met: float
    missed: float
    window_s: float
    shed: float = 0.0

    @property
    def requests(self) -> int:
        return round(self.met + self.missed)

    @property
    def fraction(self) -> float | None:
        total = self.met + self.missed
        return self.met / total if total > 0 else None


def _series(family: str, name: str, labels: Mapping[str, str]) -> str | None:
    """The series a sample of the gateway's exposition counts in, or None to skip it."""
    if family == SLO_REQUESTS and name == SLO_REQUESTS + "_total":
        outcome = labels.get(OUTCOME_LABEL)
        return outcome if outcome in OUTCOMES else None
    if family == GATEWAY_SHED and name == GATEWAY_SHED + "_total":
        return SHED
    if family == GATEWAY_PREFILL_WORK and name == GATEWAY_PREFILL_WORK + "_total":
        return WORK
    if family == GATEWAY_TPOT and name == GATEWAY_TPOT + "_bucket" and "le" in labels:
        return TPOT_BUCKET + labels["le"]
    return None  # other families, _created, _sum, _count


def parse_slo_counters(text: str) -> dict[str, dict[str, float]]:
    """class -> series -> cumulative count, from one gateway's /metrics text."""
    counts: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removesuffix("_total")
        for sample in family.samples:
            cls = sample.labels.get(SLO_CLASS_LABEL)
            series = _series(name, sample.name, sample.labels)
            if cls and series:
                per_class = counts.setdefault(cls, {})
                per_class[series] = per_class.get(series, 0.0) + sample.value
    return counts


def tpot_quantile(counts: Mapping[str, float], q: float) -> float | None:
    """The q-quantile of the TPOT histogram's increases (``tpot_le_*`` of one class), as
    PromQL's ``histogram_quantile``: linear within the bucket, the highest finite bound when
    it falls in +Inf; None without samples."""
    buckets = sorted(
        (float(k.removeprefix(TPOT_BUCKET)), v)
        for k, v in counts.items()
        if k.startswith(TPOT_BUCKET)
    )
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def _increase(values: list[float]) -> float:
    total = 0.0
    for before, after in itertools.pairwise(values):
        total += after - before if after >= before else after  # reset: counted from zero
    return total


class AttainmentTracker:
    """Samples per namespace, kept for the longest window asked for; thread-safe (kopf
    timers run in threads). ``window_s`` is SLOClass status' window; the autoscaler asks
    for its own with :meth:`keep`."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._keep_s = window_s
        self._lock = threading.Lock()
        self._samples: dict[str, deque[tuple[float, Sample]]] = {}
        self._groups: dict[str, dict[str, str]] = {}  # namespace -> pod -> service

    def keep(self, span_s: float) -> None:
        """Keep samples at least ``span_s`` back from now on (a longer window needs them)."""
        with self._lock:
            self._keep_s = max(self._keep_s, span_s)

    def record(
        self, namespace: str, t: float, sample: Sample, groups: Mapping[str, str] | None = None
    ) -> None:
        """One scrape at ``t``; ``groups``: pod -> the service whose gateway it is."""
        with self._lock:
            samples = self._samples.setdefault(namespace, deque())
            samples.append((t, sample))
            # Keep one sample at or before the longest window's start as the baseline.
            while len(samples) > 2 and samples[1][0] <= t - self._keep_s:
                samples.popleft()
            known = self._groups.setdefault(namespace, {})
            known.update(groups or {})
            live = {pod for _, s in samples for pod in s}
            for pod in [p for p in known if p not in live]:
                del known[pod]

    def last_time(self, namespace: str) -> float | None:
        with self._lock:
            samples = self._samples.get(namespace)
            return samples[-1][0] if samples else None

    def sample_count(self, namespace: str) -> int:
        with self._lock:
            return len(self._samples.get(namespace, ()))

    def increases(
        self, namespace: str, span_s: float, group: str | None = None
    ) -> tuple[Counts, float]:
        """class -> series -> increase over the last ``span_s`` (from the last sample at or
        before its start, else the oldest kept), and the span covered; only the pods of
        ``group`` when given. Empty, 0.0 until there are two samples."""
        with self._lock:
            samples = list(self._samples.get(namespace, ()))
            groups = dict(self._groups.get(namespace, {}))
        if len(samples) < 2:
            return {}, 0.0
        start = samples[-1][0] - span_s
        first = max((i for i, (t, _) in enumerate(samples) if t <= start), default=0)
        samples = samples[min(first, len(samples) - 2) :]
        span = samples[-1][0] - samples[0][0]
        pods = {pod for _, s in samples for pod in s if group is None or groups.get(pod) == group}
        baseline_pods = set(samples[0][1])
        totals: Counts = {}
        for pod in pods:
            classes = {c for _, s in samples for c in s.get(pod, {})}
            for cls in classes:
                names = {n for _, s in samples for n in s.get(pod, {}).get(cls, {})}
                for name in names:
                    # A class or series a pod had not served yet counts from zero.
                    series = [s[pod].get(cls, {}).get(name, 0.0) for _, s in samples if pod in s]
                    if pod not in baseline_pods:
                        series = [0.0, *series]  # appeared in the window: started from zero
                    per_class = totals.setdefault(cls, {})
                    per_class[name] = per_class.get(name, 0.0) + _increase(series)
        return totals, span

    def window(self, namespace: str) -> dict[str, Attainment]:
        """class -> attainment over SLOClass status' window; empty until two samples."""
        totals, span = self.increases(namespace, self.window_s)
        return {
            cls: Attainment(
                met=v.get("met", 0.0),
                missed=v.get("missed", 0.0),
                window_s=span,
                shed=v.get(SHED, 0.0),
            )
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
