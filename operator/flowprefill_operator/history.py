"""The autoscaler's windows as a history that survives the operator: per pool, the
increase of its service's gateway counters over time, kept in memory at the resolution
the windows need and written, downsampled, to the pool's ``status.autoscaler.history``.

Why status and not Prometheus: the operator reads the gateways' ``/metrics`` itself and
needs no Prometheus (many clusters running it have none, or one the operator may not
query), and status is where its other decision memory (the scale times that the
cool-downs read) already lives. It is compact: at most :data:`HISTORY_POINTS` points over
the long window (one a minute for the default hour), only the series the pool's role
decides on (prefill: met, missed and the prefill work; decode: the TPOT histogram), only
series that moved, and written at most once a point-interval and only when a counter
moved since the last write: while nothing moves the cursor in status stays true, and the
quiet time counts (as zero) in the first point after it, so nothing is lost by not writing.

What it keeps:

* ``times`` and cumulative ``totals``: the service's counters' increase since the history
  began, summed over its gateway pods (resets handled as Prometheus' ``increase()`` does:
  a counter that went down restarted from zero). A window's increase is the difference
  between the newest point and the last point at or before the window's start.
* ``cursor``: every gateway pod's raw counters at the newest point. A restarted operator,
  or a standby taking over, compares its first scrape with the cursor, so the traffic of
  the time nobody scraped (the failover, the restart) counts in the first new point
  instead of being lost in a fresh baseline; a pod the cursor does not know (started
  since) counts from zero, as the tracker counts a new gateway replica.

A pool whose status has no history (new, or never autoscaled) starts as before: its first
scrape is only a baseline, and a scale-down for idleness waits for a whole long window.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from .attainment import OUTCOMES, TPOT_BUCKET, WORK, Counts, Sample
from .models.autoscaling import AutoscalerHistory

HISTORY_POINTS = 60
"""Most points written to status over the long window (plus the baseline before it)."""
MEMORY_POINTS_PER_SHORT = 10
"""Points per short window kept in memory: the short window's start is then at most a
tenth of it off."""
PREFILL_SERIES = frozenset((*OUTCOMES, WORK))


def role_series(role: str) -> Callable[[str], bool]:
    """The series the policy reads for a pool of ``role`` (prefill: attainment and the
    load; decode: the TPOT histogram)."""
    if role == "decode":
        return lambda name: name.startswith(TPOT_BUCKET)
    return lambda name: name in PREFILL_SERIES


@dataclass(frozen=True)
class HistorySettings:
    """What a pool's history keeps: ``keep_s`` back (its long window), points at least
    ``step_s`` apart in memory and ``persist_step_s`` apart in status, the role's series."""

    keep_s: float
    step_s: float
    persist_step_s: float
    role: str

    @classmethod
    def of(cls, short_window_s: float, long_window_s: float, role: str) -> HistorySettings:
        persist = long_window_s / HISTORY_POINTS
        return cls(
            keep_s=long_window_s,
            step_s=min(persist, short_window_s / MEMORY_POINTS_PER_SHORT),
            persist_step_s=persist,
            role=role,
        )


def _add(total: Counts, delta: Counts) -> Counts:
    out = {cls: dict(series) for cls, series in total.items()}
    for cls, series in delta.items():
        per_class = out.setdefault(cls, {})
        for name, v in series.items():
            per_class[name] = per_class.get(name, 0.0) + v
    return out


def _minus(after: Counts, before: Counts) -> Counts:
    out: Counts = {}
    for cls, series in after.items():
        for name, v in series.items():
            d = v - before.get(cls, {}).get(name, 0.0)
            if d:
                out.setdefault(cls, {})[name] = d
    return out


class WindowHistory:
    """One pool's history (not thread-safe: the autoscaler holds the service's lock)."""

    def __init__(self, settings: HistorySettings) -> None:
        self.settings = settings
        self._wanted = role_series(settings.role)
        self.times: list[float] = []
        self.totals: list[Counts] = []
        self.cursor: Sample | None = None

    def _filter(self, sample: Sample) -> Sample:
        return {
            pod: {
                cls: {n: v for n, v in series.items() if self._wanted(n)}
                for cls, series in classes.items()
            }
            for pod, classes in sample.items()
        }

    @property
    def last_time(self) -> float | None:
        return self.times[-1] if self.times else None

    def advance(self, t: float, sample: Sample, live: Collection[str] = ()) -> None:
        """Fold in one scrape of the service's gateway pods at wall time ``t`` (a scrape no
        newer than the newest point is ignored). ``live``: the gateway pods that exist,
        answered or not: one that did not answer this time keeps its cursor (otherwise
        its next answer would count its whole total as new traffic)."""
        sample = self._filter(sample)
        if self.cursor is not None:
            sample |= {p: c for p, c in self.cursor.items() if p in live and p not in sample}
        if self.cursor is None or not self.times:
            self.times, self.totals, self.cursor = [t], [{}], sample
            return
        if t <= self.times[-1]:
            return
        delta: Counts = {}
        for pod, classes in sample.items():
            before = self.cursor.get(pod)
            for cls, series in classes.items():
                for name, now in series.items():
                    if before is None:
                        inc = now  # a pod started since: counted from zero
                    else:
                        prev = before.get(cls, {}).get(name, 0.0)
                        inc = now - prev if now >= prev else now  # reset: from zero
                    if inc:
                        per_class = delta.setdefault(cls, {})
                        per_class[name] = per_class.get(name, 0.0) + inc
        total = _add(self.totals[-1], delta)
        if len(self.times) >= 2 and t - self.times[-2] < self.settings.step_s:
            self.times[-1], self.totals[-1] = t, total  # the newest point moves forward
        else:
            self.times.append(t)
            self.totals.append(total)
        # Keep one point at or before the long window's start as its baseline.
        while len(self.times) > 2 and self.times[1] <= t - self.settings.keep_s:
            del self.times[0], self.totals[0]
        self.cursor = sample

    def increases(self, span_s: float) -> tuple[Counts, float]:
        """class -> series -> increase over the last ``span_s`` (from the last point at or
        before its start, else the oldest kept), and the span covered; empty, 0.0 until
        there are two points."""
        if len(self.times) < 2:
            return {}, 0.0
        start = self.times[-1] - span_s
        first = max((i for i, t in enumerate(self.times) if t <= start), default=0)
        first = min(first, len(self.times) - 2)
        return _minus(self.totals[-1], self.totals[first]), self.times[-1] - self.times[first]

    def wire(self) -> AutoscalerHistory | None:
        """The history for status: the newest point, then points at least the persist step
        apart back to the baseline, at most :data:`HISTORY_POINTS` + 2; None when empty."""
        if not self.times or self.cursor is None:
            return None
        picked = [len(self.times) - 1]
        for i in range(len(self.times) - 2, -1, -1):
            if i == 0 or self.times[picked[-1]] - self.times[i] >= self.settings.persist_step_s:
                picked.append(i)
        picked = picked[: HISTORY_POINTS + 2][::-1]
        counts: dict[str, dict[str, list[float]]] = {}
        for k, (a, b) in enumerate(itertools.pairwise(picked)):
            for cls, series in _minus(self.totals[b], self.totals[a]).items():
                for name, v in series.items():
                    row = counts.setdefault(cls, {}).setdefault(name, [0.0] * (len(picked) - 1))
                    row[k] = _round(v)
        return AutoscalerHistory(
            times=[round(self.times[i], 3) for i in picked],
            counts=counts,
            cursor=self.cursor_wire(),
        )

    def cursor_wire(self) -> dict[str, dict[str, dict[str, float]]]:
        """The cursor as status holds it (rounded, classes without series left out)."""
        return {
            pod: {cls: {n: _round(v) for n, v in s.items()} for cls, s in c.items() if s}
            for pod, c in (self.cursor or {}).items()
        }

    @classmethod
    def from_wire(cls, wire: AutoscalerHistory, settings: HistorySettings) -> WindowHistory:
        """The history written by :meth:`wire` (by this operator or another); one that does
        not hold together (lengths, order) gives an empty history, as if never written."""
        history = cls(settings)
        times = list(wire.times)
        n = len(times)
        ordered = all(a < b for a, b in itertools.pairwise(times))
        rows_fit = all(len(r) == n - 1 for s in wire.counts.values() for r in s.values())
        if n == 0 or not ordered or not rows_fit or not all(map(math.isfinite, times)):
            return history
        totals: list[Counts] = [{}]
        for k in range(n - 1):
            step = {
                c: {name: row[k] for name, row in s.items() if history._wanted(name) and row[k]}
                for c, s in wire.counts.items()
            }
            totals.append(_add(totals[-1], step))
        history.times, history.totals = times, totals
        history.cursor = history._filter(
            {pod: {c: dict(s) for c, s in classes.items()} for pod, classes in wire.cursor.items()}
        )
        return history


def _round(v: float) -> float:
    """Counts are integers; the prefill work is in seconds: a millisecond is plenty."""
    return round(v, 3)


def newer(wire: AutoscalerHistory | None, memory: WindowHistory | None) -> bool:
    """Whether status holds a newer history than memory (another replica wrote it while
    this one stood by, or this one just started)."""
    if wire is None or not wire.times:
        return False
    return memory is None or memory.last_time is None or wire.times[-1] > memory.last_time


def pods_of(sample: Sample, services: Mapping[str, str], service: str) -> Sample:
    """The part of a namespace's scrape that is ``service``'s gateways."""
    return {pod: c for pod, c in sample.items() if services.get(pod) == service}
