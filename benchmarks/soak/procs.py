"""Resident memory and open file descriptors of every process of a running stack, sampled
over time, and the plot of them (for ``benchmarks/soak/soak.py``).

The processes are the tree under ``flowprefill up``'s supervisor (itself included), each
labelled by its role from its command line (``benchmarks.stack.common.role_of``) and its pid: a
process ``up`` restarts comes back under a new pid, so it shows as one series that ends
and another that begins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks.stack.common import role_of

MB = 1 << 20


@dataclass
class Series:
    """One process's samples: seconds since the start of the load, RSS in MB, open fds."""

    label: str
    role: str
    pid: int
    cmdline: str = ""
    t_s: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)

    def between(self, t0_s: float, t1_s: float) -> Series:
        """The samples taken from ``t0_s`` to ``t1_s``."""
        keep = [i for i, t in enumerate(self.t_s) if t0_s <= t <= t1_s]
        return Series(
            self.label,
            self.role,
            self.pid,
            self.cmdline,
            [self.t_s[i] for i in keep],
            [self.rss_mb[i] for i in keep],
            [self.fds[i] for i in keep],
        )


Probe = Callable[[], float | None]
"""A gauge read along with each sample (None: not available this time)."""


class TreeSampler:
    """Samples the process tree under ``root_pid`` on each :meth:`sample` call, and reads
    ``probes`` (the stack's own gauges: what was in flight, so that growth under a backlog
    can be told from a leak)."""

    def __init__(self, root_pid: int, probes: dict[str, Probe] | None = None) -> None:
        self.root = psutil.Process(root_pid)
        self.series: dict[int, Series] = {}
        self.probes = probes or {}
        self.gauges: dict[str, list[tuple[float, float]]] = {name: [] for name in self.probes}
        self.num_samples = 0

    def _processes(self) -> Iterator[psutil.Process]:
        yield self.root
        yield from self.root.children(recursive=True)

    def sample(self, t_s: float) -> None:
        """One sample of every process alive now; one that exits meanwhile is skipped."""
        self.num_samples += 1
        for name, probe in self.probes.items():
            value = probe()
            if value is not None:
                self.gauges[name].append((t_s, value))
        try:
            procs = list(self._processes())
        except psutil.NoSuchProcess:
            return  # the supervisor itself is gone: nothing left to sample
        for p in procs:
            try:
                with p.oneshot():
                    rss = p.memory_info().rss
                    fds = p.num_fds()
                    s = self.series.get(p.pid)
                    if s is None:
                        cmdline = " ".join(p.cmdline()) or p.name()
                        role = role_of(cmdline)
                        if role == "other":
                            role = f"other: {p.name()}"
                        label = f"{role} ({p.pid})"
                        s = self.series[p.pid] = Series(label, role, p.pid, cmdline[:300])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            s.t_s.append(t_s)
            s.rss_mb.append(rss / MB)
            s.fds.append(fds)

    def lost(self) -> list[Series]:
        """Processes with a role of the stack that were there at the first sample and were
        not at the last: a crash (``up`` restarts it under another pid) or an exit."""
        if not self.series:
            return []
        first = min(s.t_s[0] for s in self.series.values())
        last = max(s.t_s[-1] for s in self.series.values())
        return [
            s
            for s in self.series.values()
            if not s.role.startswith("other") and s.t_s[0] == first and s.t_s[-1] < last
        ]


def plot(
    path: Path,
    series: list[Series],
    gauges: dict[str, list[tuple[float, float]]],
    marks_s: dict[str, float],
    title: str,
) -> None:
    """RSS, open fds and the gauges against minutes into the load; ``marks_s``: vertical
    dotted lines (the end of the warm-up, the last arrival), named in the x label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 11), sharex=True)
    ax_rss, ax_fds, ax_gauge = axes
    for s in series:
        minutes = [t / 60 for t in s.t_s]
        ax_rss.plot(minutes, s.rss_mb, label=s.label)
        ax_fds.plot(minutes, s.fds, label=s.label)
    for name, points in gauges.items():
        ax_gauge.plot([t / 60 for t, _ in points], [v for _, v in points], label=name)
    for ax in axes:
        for t_s in marks_s.values():
            ax.axvline(t_s / 60, color="grey", linestyle=":")
        ax.grid(alpha=0.3)
    ax_rss.set_ylabel("RSS (MB)")
    ax_fds.set_ylabel("open file descriptors")
    ax_gauge.set_ylabel("the stack's gauges")
    ax_gauge.set_xlabel("minutes into the load (dotted: " + ", ".join(marks_s) + ")")
    ax_rss.set_title(title)
    ax_rss.legend(fontsize="small", loc="center left", bbox_to_anchor=(1, 0.5))
    if gauges:
        ax_gauge.legend(fontsize="small", loc="center left", bbox_to_anchor=(1, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
