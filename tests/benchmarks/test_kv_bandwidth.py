"""benchmarks/kv/bandwidth.py: a tiny real run in which every transport (memcpy, NIXL over
UCX's defaults and over tcp, the project's HTTP pull) moves its bytes intact at a positive
rate — the benchmark CRC-checks every transfer itself and raises TransferCorrupted on a
mismatch, which would fail this test — and the helpers that check it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.kv import bandwidth, bw_nixl
from benchmarks.kv.bandwidth import ROWS, rotated
from benchmarks.kv.bw_common import (
    BLOCK,
    TOKEN_BYTES,
    TransferCorrupted,
    check_received,
    crc32,
    fill_pattern,
    parse_size,
    run_memcpy,
    whole_tokens,
)

SIZES = (1 << 20, 4 << 20)


@pytest.mark.slow
def test_a_tiny_run_moves_every_byte_of_every_transport(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "kvbw.json", tmp_path / "kvbw.png"
    argv = ["--sizes", "1M,4M", "--repeats", "1", "--json", str(out), "--plot", str(png)]
    assert bandwidth.main(argv) == 0
    data = json.loads(out.read_text())
    samples: list[dict[str, Any]] = data["samples"]
    nixl = bw_nixl.nixl_module() is not None
    want_rows = [r for r in ROWS if nixl or not r.startswith("nixl")]
    assert sorted((s["row"], s["nbytes"]) for s in samples) == sorted(
        (r, n) for r in want_rows for n in SIZES
    )
    assert all(s["seconds"] > 0 and s["gbps"] > 0 for s in samples)
    for s in samples:
        if s["row"].startswith("nixl"):  # the READ's notification reached the producer
            assert "timed" in s["extra"]["notifs"], s
        if s["row"].startswith("http"):  # the whole hand-off file: KV + token ids + header
            assert s["moved_bytes"] == s["extra"]["file_bytes"] > s["nbytes"], s
    if not nixl:
        assert data["skipped"] == {
            "nixl-cma": "nixl not installed",
            "nixl-tcp": "nixl not installed",
        }
    printed = capsys.readouterr().out
    assert "[8/8]" in printed and "http write+pull" in printed and "best/memcpy" in printed
    assert png.stat().st_size > 0


def test_a_corrupted_copy_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    real = np.copyto

    def flipping(dst: Any, src: Any) -> None:
        real(dst, src)
        dst[-1] ^= 1

    monkeypatch.setattr(np, "copyto", flipping)
    with pytest.raises(TransferCorrupted, match="memcpy"):
        run_memcpy(1 << 20, seed=1)


def test_check_received_compares_crcs() -> None:
    check_received("x", 5, 5)
    with pytest.raises(TransferCorrupted, match="other bytes"):
        check_received("x", 5, 6)


def test_the_fill_pattern_tells_blocks_apart() -> None:
    buf = np.empty(3 * BLOCK + 100, np.uint8)
    fill_pattern(buf, seed=7)
    swapped = buf.copy()
    swapped[:BLOCK], swapped[BLOCK : 2 * BLOCK] = (
        buf[BLOCK : 2 * BLOCK].copy(),
        buf[:BLOCK].copy(),
    )
    assert crc32(swapped) != crc32(buf)
    other = np.empty_like(buf)
    fill_pattern(other, seed=8)
    assert crc32(other) != crc32(buf)


def test_sizes_and_rotation() -> None:
    assert parse_size("64M") == 64 << 20 and parse_size("1G") == 1 << 30
    assert parse_size("512KiB") == 512 << 10 and parse_size("4096") == 4096
    assert whole_tokens(64 << 20) == 64 << 20 and whole_tokens(1) == TOKEN_BYTES
    orders = [rotated(bandwidth.TRANSPORTS, k) for k in range(4)]
    assert [o[0] for o in orders] == list(bandwidth.TRANSPORTS)  # each leads once


def test_without_nixl_its_rows_say_so_and_the_rest_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bw_nixl, "NIXL_PACKAGES", ("no_such_nixl_package",))
    out = tmp_path / "kvbw.json"
    argv = [
        "--sizes",
        "1M",
        "--repeats",
        "1",
        "--transports",
        "memcpy,nixl-tcp",
        "--json",
        str(out),
    ]
    assert bandwidth.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["skipped"] == {"nixl-tcp": "nixl not installed"}
    assert [s["row"] for s in data["samples"]] == ["memcpy"]
    printed = capsys.readouterr().out
    assert "nixl-tcp 1 MiB: skipped (nixl not installed)" in printed
    assert "nixl not installed" in printed.split("best/memcpy")[1]  # the table's row
