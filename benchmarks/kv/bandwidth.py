"""KV hand-off bandwidth per transport, beside memcpy, in one interleaved run on one machine.

Moves N bytes of KV from a producer to a consumer on loopback (default 64 MiB, 256 MiB and
1 GiB) and reports GB/s (10^9 bytes/s) per transport and size — best and median over the
repeats, and each as a ratio to memcpy at that size:

* ``memcpy`` — ``np.copyto`` into a pre-touched destination, in one process: the ceiling.
* ``nixl-cma`` — NIXL READ (UCX backend, UCX's default transports, ``UCX_TLS`` unset: on one
  host UCX picks ``cma``, i.e. ``process_vm_readv``) by a consumer process from a producer
  process's registered DRAM.
* ``nixl-tcp`` — the same with ``UCX_TLS=tcp`` in both processes (what also works across
  hosts and network namespaces), each NIXL cell in fresh processes.
* ``http pull`` — today's ``http`` transport with the project's real pieces: the prefill's
  KV listener app under uvicorn in a subprocess, and the decode side's
  :class:`~flowprefill.kv.HTTPPullTransport` ``fetch()``.
* ``http write+pull`` — that pull plus the producer's ``SharedDirTransport.put`` of the
  hand-off, in sequence.

This module is the command line, the interleaved run, and the table, JSON and plot. The
pieces, each with what it times and what it does not:

* ``bw_common.py`` — the payload (a Llama-3-8B-shaped KV, whole 128 KiB tokens), sizes,
  the fill pattern and the CRC-32 checks every transfer passes (or the run stops with
  :class:`~benchmarks.kv.bw_common.TransferCorrupted`), and ``memcpy``.
* ``bw_nixl.py`` — the NIXL producer and consumer processes.
* ``bw_http.py`` — the KV listener subprocess and the decode-side pull.

Interleaving: for each repeat, every size in ascending order and at each size every
transport, the order rotated by one per (repeat, size), so slow phases of the shared
machine spread over all transports. Buffers live for one cell (one transport, one size,
one repeat) and are freed after it: at 1 GiB a cell holds 2-3 GiB.

    python benchmarks/kv/bandwidth.py                                   # 64M,256M,1G x5
    python benchmarks/kv/bandwidth.py --sizes 64M,256M,1G --repeats 3 \\
        --json /tmp/kvbw.json --plot docs/img/kv_bandwidth.png

If no NIXL package is importable (the ``nixl_cu13``/``nixl_cu12`` wheels, or the ``nixl``
meta package over them; see :data:`~benchmarks.kv.bw_nixl.NIXL_PACKAGES`), the NIXL rows
say "nixl not installed" and the rest still runs.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Run as a script: the repository root goes on the path so that ``benchmarks`` imports as a
# package (and so do the spawned NIXL and KV listener processes, which import their targets
# from ``benchmarks.kv.bw_nixl`` / ``benchmarks.kv.bw_http``).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kv.bw_common import TOKEN_BYTES, parse_size, run_memcpy, size_label, whole_tokens
from benchmarks.kv.bw_http import HTTPPath
from benchmarks.kv.bw_nixl import NIXL_ENV, nixl_module, run_nixl

TRANSPORTS = ("memcpy", "nixl-cma", "nixl-tcp", "http")
"""What one cell runs; ``http`` gives two rows (pull, write+pull)."""
ROWS = ("memcpy", "nixl-cma", "nixl-tcp", "http pull", "http write+pull")


@dataclass
class Sample:
    """One timed transfer: ``row`` at ``nbytes`` in ``repeat`` (``slot``: its place in that
    size's rotated order)."""

    row: str
    size: str
    nbytes: int
    repeat: int
    slot: int
    seconds: float
    moved_bytes: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.moved_bytes / self.seconds / 1e9


# ---------------------------------------------------------------------------- the run


def rotated(items: Sequence[str], by: int) -> list[str]:
    k = by % len(items)
    return [*items[k:], *items[:k]]


def cell_timeout_s(nbytes: int) -> float:
    """Generous: a 2-core machine shared with other work, page faults at ~0.3 GB/s."""
    return 120.0 + nbytes / 20e6


Measured = tuple[str, float, int, dict[str, Any]]
"""One row's figure from a cell: (row, seconds, bytes moved, details)."""


def run_cell(
    transport: str, nbytes: int, seed: int, module: str | None, http: HTTPPath | None
) -> list[Measured]:
    """One transport at one size, once (buffers made and freed inside)."""
    if transport == "memcpy":
        seconds, extra = run_memcpy(nbytes, seed)
        return [(transport, seconds, nbytes, extra)]
    if transport in NIXL_ENV:
        assert module is not None
        env = NIXL_ENV[transport]
        seconds, extra = run_nixl(module, env, nbytes, seed, cell_timeout_s(nbytes))
        return [(transport, seconds, nbytes, extra)]
    if transport == "http":
        assert http is not None
        write_s, pull_s, extra = http.run(nbytes, seed, f"kvbw-{uuid.uuid4().hex[:12]}")
        moved = extra["file_bytes"]
        both = {**extra, "write_s": write_s, "pull_s": pull_s}
        return [
            ("http pull", pull_s, moved, extra),
            ("http write+pull", write_s + pull_s, moved, both),
        ]
    raise ValueError(f"unknown transport {transport!r}")


def run_all(
    sizes: Sequence[int],
    repeats: int,
    transports: Sequence[str],
    work: Path,
    say: Callable[[str], None] = print,
) -> tuple[list[Sample], dict[str, str]]:
    """Every (repeat, size, transport) cell, interleaved; the samples and the rows skipped
    (row -> why)."""
    module = nixl_module()
    skipped = {t: "nixl not installed" for t in NIXL_ENV if t in transports and module is None}
    samples: list[Sample] = []
    total = repeats * len(sizes) * len(transports)
    counter = itertools.count(1)
    with contextlib.ExitStack() as stack:
        http = stack.enter_context(HTTPPath(work)) if "http" in transports else None
        for repeat in range(repeats):
            for index, nbytes in enumerate(sizes):
                label = size_label(nbytes)
                seed = repeat * 1000 + index + 1  # other bytes every cell
                for slot, transport in enumerate(rotated(transports, repeat + index)):
                    step = f"[{next(counter)}/{total}] {transport} {label}"
                    if transport in skipped:
                        say(f"{step}: skipped ({skipped[transport]})")
                        continue
                    figures = []
                    for row, seconds, moved, extra in run_cell(
                        transport, nbytes, seed, module, http
                    ):
                        sample = Sample(row, label, nbytes, repeat, slot, seconds, moved, extra)
                        samples.append(sample)
                        name = row.removeprefix(transport).strip()
                        figures.append(f"{name + ' ' if name else ''}{sample.gbps:.2f} GB/s")
                    say(f"{step}: {', '.join(figures)}")
    return samples, skipped


@dataclass
class Summary:
    row: str
    size: str
    nbytes: int
    n: int
    best_gbps: float
    median_gbps: float
    best_vs_memcpy: float | None
    median_vs_memcpy: float | None


def summarize(samples: Sequence[Sample], sizes: Sequence[int]) -> list[Summary]:
    """Best and median GB/s per (row, size), and their ratios to memcpy's at that size."""
    by: dict[tuple[str, int], list[float]] = {}
    for s in samples:
        by.setdefault((s.row, s.nbytes), []).append(s.gbps)
    out = []
    for row in ROWS:
        for nbytes in sizes:
            values = by.get((row, nbytes))
            if not values:
                continue
            base = by.get(("memcpy", nbytes))
            best, median = max(values), statistics.median(values)
            out.append(
                Summary(
                    row,
                    size_label(nbytes),
                    nbytes,
                    len(values),
                    best,
                    median,
                    best / max(base) if base else None,
                    median / statistics.median(base) if base else None,
                )
            )
    return out


def print_table(
    summary: Sequence[Summary], skipped: Mapping[str, str], sizes: Sequence[int], repeats: int
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"KV hand-off bandwidth on loopback, GB/s (10^9 B/s), best and median of {repeats}",
        title_justify="left",
    )
    for name in ("transport", "size", "best", "median", "best/memcpy", "median/memcpy"):
        table.add_column(name, justify="left" if name in ("transport", "size") else "right")

    def ratio(value: float | None) -> str:
        return "" if value is None else f"{value:.2f}"

    for row in ROWS:
        rows = [s for s in summary if s.row == row]
        if row in skipped:
            for nbytes in sizes:
                table.add_row(row, size_label(nbytes), skipped[row], "", "", "")
        for s in rows:
            table.add_row(
                row,
                s.size,
                f"{s.best_gbps:.2f}",
                f"{s.median_gbps:.2f}",
                ratio(s.best_vs_memcpy),
                ratio(s.median_vs_memcpy),
            )
        if rows or row in skipped:
            table.add_section()
    Console(width=100).print(table)


def plot(summary: Sequence[Summary], path: Path, repeats: int) -> bool:
    """GB/s against size per transport (median, best as hollow markers); False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for row in ROWS:
        rows = sorted((s for s in summary if s.row == row), key=lambda s: s.nbytes)
        if not rows:
            continue
        x = [s.nbytes / 2**20 for s in rows]
        (line,) = ax.plot(x, [s.median_gbps for s in rows], marker="o", label=row)
        ax.plot(
            x, [s.best_gbps for s in rows], linestyle="none", marker="^",
            markerfacecolor="none", color=line.get_color(),
        )  # fmt: skip
    ax.set_xscale("log", base=2)
    ticks = sorted({s.nbytes for s in summary})
    ax.set_xticks([t / 2**20 for t in ticks], [size_label(t) for t in ticks])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("hand-off size")
    ax.set_ylabel("GB/s (10^9 B/s)")
    ax.set_title(
        f"KV hand-off bandwidth, producer → consumer on loopback (median of {repeats}, △ best)"
    )
    ax.title.set_fontsize(10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print the table; exit status 0. A corrupted transfer raises TransferCorrupted."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--sizes", default="64M,256M,1G", help="comma list: 64M, 1G, 4096...")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--transports", default=",".join(TRANSPORTS), help=f"subset of {','.join(TRANSPORTS)}"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every sample here")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of GB/s vs size")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    requested = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    sizes = sorted({whole_tokens(n) for n in requested})
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = sorted(set(transports) - set(TRANSPORTS))
    if unknown or not transports:
        parser.error(f"--transports: unknown {unknown}; choose from {', '.join(TRANSPORTS)}")
    module = nixl_module()
    print(
        f"sizes {', '.join(size_label(n) for n in sizes)} (whole {TOKEN_BYTES // 1024} KiB "
        f"tokens of a Llama-3-8B-shaped KV), {args.repeats} repeat(s), transports "
        f"{', '.join(transports)}; NIXL: {module or 'not installed'}",
        flush=True,
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvbw-") as tmp:
        samples, skipped = run_all(
            sizes, args.repeats, transports, Path(tmp), lambda m: print(m, flush=True)
        )
    summary = summarize(samples, sizes)
    print(f"done in {time.monotonic() - started:.0f} s")
    print_table(summary, skipped, sizes, args.repeats)
    if args.json is not None:
        out = {
            "config": {
                "sizes": sizes,
                "requested_sizes": requested,
                "repeats": args.repeats,
                "transports": transports,
                "token_bytes": TOKEN_BYTES,
                "nixl_module": module,
                "cpus": os.cpu_count(),
                "gbps_unit": "1e9 bytes/s",
            },
            "skipped": skipped,
            "samples": [{**asdict(s), "gbps": s.gbps} for s in samples],
            "summary": [asdict(s) for s in summary],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
        print(f"samples: {args.json}")
    if args.plot is not None:
        print(
            f"plot: {args.plot}"
            if plot(summary, args.plot, args.repeats)
            else "plot: no matplotlib"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
