"""What every transport of benchmarks/kv/bandwidth.py shares: the payload, its sizes, the
fill pattern and the CRC-32 checks, and the ``memcpy`` ceiling.

Payload: a Llama-3-8B-shaped prompt KV (32 layers x 8 KV heads x head_dim 128, bfloat16:
128 KiB per token); each size is rounded up to whole tokens (64 MiB = 512 tokens, 1 GiB =
8192) and every transport moves that many bytes. The http rows move the hand-off file,
which adds the token ids (8 B per token) and the safetensors header (~5 KiB): their GB/s
count the file's bytes.

Every transfer is checked: the consumer's CRC-32 of the bytes it received must equal the
producer's CRC-32 of what it sent (NIXL, memcpy: the buffer; http: the whole file), or
the run stops with :class:`TransferCorrupted`. The data is a 1 MiB random block repeated
with each copy's index in its first 8 bytes, so a misplaced or duplicated block fails too.

``memcpy`` — ``np.copyto`` into a pre-touched destination, in one process: the ceiling.
Timed: one ``np.copyto`` after a warm-up copy and a re-zeroing of the destination.
"""

from __future__ import annotations

import argparse
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

# A Llama-3-8B-shaped KV cache: 32 layers, 8 KV heads, head_dim 128, bfloat16.
LAYERS, KV_HEADS, HEAD_DIM, ELEMENT_BYTES = 32, 8, 128, 2
TOKEN_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * ELEMENT_BYTES  # k and v: 128 KiB per token

BLOCK = 1 << 20  # the fill pattern's period
CRC_CHUNK = 16 << 20  # file CRCs read this much at a time (no whole-file buffer)
Bytes = npt.NDArray[np.uint8]


class TransferCorrupted(RuntimeError):
    """The bytes a consumer received differ from what the producer sent."""


def parse_size(text: str) -> int:
    """``64M`` / ``1G`` / ``512K`` (binary units) or a byte count."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    value = int(float(number) * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return value


def size_label(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{nbytes} B"


def whole_tokens(nbytes: int) -> int:
    """The payload actually moved for a requested size: rounded up to whole tokens."""
    return -(-nbytes // TOKEN_BYTES) * TOKEN_BYTES


def fill_pattern(buf: Bytes, seed: int) -> None:
    """Fill ``buf`` (touching every page) with a 1 MiB random block repeated, each copy
    stamped with its index: cheap to make, and a misplaced block changes the CRC."""
    block = np.random.default_rng(seed).integers(0, 256, size=min(BLOCK, buf.size), dtype=np.uint8)
    rows = buf.size // BLOCK
    if rows:
        grid = buf[: rows * BLOCK].reshape(rows, BLOCK)
        grid[:] = block
        stamps = np.arange(rows, dtype="<u8") + (seed << 32)
        grid[:, :8] = stamps.view(np.uint8).reshape(rows, 8)
    tail = buf[rows * BLOCK :]
    tail[:] = block[: tail.size]


def crc32(buf: Bytes) -> int:
    return zlib.crc32(buf.data)


def file_crc32(path: Path) -> int:
    crc, chunk = 0, bytearray(CRC_CHUNK)
    view = memoryview(chunk)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(chunk):
            crc = zlib.crc32(view[:n], crc)
    return crc


def check_received(what: str, sent_crc: int, received_crc: int) -> None:
    """Raise :class:`TransferCorrupted` unless the CRC-32s of sent and received bytes match."""
    if sent_crc != received_crc:
        raise TransferCorrupted(
            f"{what}: the consumer received other bytes than the producer sent "
            f"(CRC-32 {received_crc:#010x}, sent {sent_crc:#010x})"
        )


# ---------------------------------------------------------------------------- memcpy


def run_memcpy(nbytes: int, seed: int) -> tuple[float, dict[str, Any]]:
    src = np.empty(nbytes, np.uint8)
    fill_pattern(src, seed)
    dst = np.zeros(nbytes, np.uint8)
    dst.fill(0)  # np.zeros may map lazily-zeroed pages: touch them
    np.copyto(dst, src)  # warm-up
    dst.fill(0)  # so the check below sees the timed copy's bytes, not the warm-up's
    t0 = time.perf_counter()
    np.copyto(dst, src)
    seconds = time.perf_counter() - t0
    check_received("memcpy", crc32(src), crc32(dst))
    return seconds, {}
