"""How ``flowprefill up --decode-aware`` wires decode-aware preemption on one machine: each
prefill instance's beat socket and the operator-splitting bound that lets a park come in
time (docs/executor.md, "Decode-aware preemption")."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Literal, cast

from flowprefill.contracts.beats import MAX_SOCKET_PATH_BYTES
from flowprefill.contracts.engine import DEFAULT_TBT_TARGET_S

DECODE_AWARE_BLOCKING_SHARE = 0.25
"""With decode-aware preemption, operators are split so that no stretch between two
checkpoints runs longer than this share of the TBT target (unless ``--max-blocking-ms``
says otherwise): a park can only come at a checkpoint, and a stretch as long as the
target leaves decode no time (docs/executor.md)."""


def decode_aware_blocking_ms(args: argparse.Namespace) -> float | Literal["off"]:
    """``--max-blocking-ms``, else a quarter of the TBT target decode-aware parks protect."""
    if args.max_blocking_ms is not None:
        return cast(float | Literal["off"], args.max_blocking_ms)
    tbt = getattr(args, "decode_aware_tbt", DEFAULT_TBT_TARGET_S)
    return float(tbt) * 1e3 * DECODE_AWARE_BLOCKING_SHARE


def beat_socket_path(run_dir: Path, index: int) -> str:
    """Where prefill instance ``index`` listens for decode's beats: in the run folder, or
    under /tmp when that path is too long for a Unix socket address
    (:data:`~flowprefill.contracts.beats.MAX_SOCKET_PATH_BYTES`)."""
    path = str(run_dir / f"beats-{index}.sock")
    if len(path.encode()) <= MAX_SOCKET_PATH_BYTES:
        return path
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:12]
    return f"/tmp/flowprefill-beats-{digest}-{index}.sock"
