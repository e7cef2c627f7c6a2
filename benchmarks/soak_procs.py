"""Resident memory and open file descriptors of every process of a running stack, sampled
over time, and the plot of them (for ``benchmarks/soak.py``).

The processes are the tree under ``flowprefill up``'s supervisor (itself included), each
labelled by its role from its command line (``stack_common.role_of``) and its pid: a
process ``up`` restarts comes back under a new pid, so it shows as one series that ends
and another that begins.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from stack_common import role_of

MB = 1 << 20


@dataclass
class Series:
    """One process's samples: seconds since the start of the load, RSS in MB, open fds."""

    label: str
    role: str
    pid: int
    t_s: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)

    def since(self, t0_s: float) -> Series:
        """The samples taken at or after ``t0_s``."""
        keep = [i for i, t in enumerate(self.t_s) if t >= t0_s]
        return Series(
            self.label,
            self.role,
            self.pid,
            [self.t_s[i] for i in keep],
            [self.rss_mb[i] for i in keep],
            [self.fds[i] for i in keep],
        )


class TreeSampler:
    """Samples the process tree under ``root_pid`` on each :meth:`sample` call."""

    def __init__(self, root_pid: int) -> None:
        self.root = psutil.Process(root_pid)
        self.series: dict[int, Series] = {}
        self.num_samples = 0

    def _processes(self) -> Iterator[psutil.Process]:
        yield self.root
        yield from self.root.children(recursive=True)

    def sample(self, t_s: float) -> None:
        """One sample of every process alive now; one that exits meanwhile is skipped."""
        self.num_samples += 1
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
                        s = self.series[p.pid] = Series(f"{role} ({p.pid})", role, p.pid)
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


def plot(path: Path, series: list[Series], warmup_s: float, title: str) -> None:
    """RSS (top) and open fds (bottom) of every process against minutes into the load;
    the dotted line is the end of the warm-up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rss, ax_fds) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    for s in series:
        minutes = [t / 60 for t in s.t_s]
        ax_rss.plot(minutes, s.rss_mb, label=s.label)
        ax_fds.plot(minutes, s.fds, label=s.label)
    for ax in (ax_rss, ax_fds):
        ax.axvline(warmup_s / 60, color="grey", linestyle=":")
        ax.grid(alpha=0.3)
    ax_rss.set_ylabel("RSS (MB)")
    ax_fds.set_ylabel("open file descriptors")
    ax_fds.set_xlabel("minutes into the load (dotted: end of warm-up)")
    ax_rss.set_title(title)
    ax_rss.legend(fontsize="small", loc="center left", bbox_to_anchor=(1, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
