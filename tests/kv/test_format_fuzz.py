"""The hand-off reader against hostile and broken files and HTTP bodies (hypothesis).

A hand-off comes from a shared volume or a pod on the network. Whatever the bytes, reading
one must either give back exactly what was written or raise a
:class:`~flowprefill.errors.KVHandoffError` (the connector's signal to recompute) — quickly,
and without allocating what a lying header declares.
"""

from __future__ import annotations

import contextlib
import json
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowprefill.contracts.kv import HandoffRef
from flowprefill.errors import KVFormatError, KVHandoffError
from flowprefill.kv import (
    HTTPPullTransport,
    ModelFingerprint,
    SharedDirTransport,
    build_handoff,
    read_handoff,
    read_header,
    write_handoff,
)
from flowprefill.kv.format import KVHandoff, parse_file_header
from flowprefill.prefill.server.kv_http import create_kv_app
from tests.helpers import serve_in_thread

FP = ModelFingerprint("llama", 2, 2, 8, 32, 100, 10000.0)
NUM_TOKENS = 7
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# A single read of a ~2 KiB hand-off: anything near these bounds means the reader built
# or waited for something a header declared rather than what the bytes hold.
TIME_BOUND_S = 2.0
PEAK_BOUND_BYTES = 16 << 20


def make_handoff() -> KVHandoff:
    gen = torch.Generator().manual_seed(0)
    shape = (FP.num_kv_heads, NUM_TOKENS, FP.head_dim)
    layers = [
        (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        for _ in range(FP.num_layers)
    ]
    return build_handoff(layers, list(range(3, 3 + NUM_TOKENS)), FP, "r1", first_token_id=42)


HANDOFF = make_handoff()


@pytest.fixture(scope="module")
def good_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_handoff(HANDOFF, tmp_path_factory.mktemp("kv") / "good").read_bytes()


def same_as_written(got: KVHandoff) -> bool:
    return got.token_ids == HANDOFF.token_ids and all(
        torch.equal(a, b)
        for pair, want in zip(got.layers, HANDOFF.layers, strict=True)
        for a, b in zip(pair, want, strict=True)
    )


def bounded(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; fail if it took long or allocated much (Python heap; safetensors maps
    files, so a declared size it believed would show up as time or an error, not here)."""
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        return fn()
    finally:
        elapsed = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert elapsed < TIME_BOUND_S, f"took {elapsed:.1f} s"
        assert peak < PEAK_BOUND_BYTES, f"allocated {peak} bytes"


def check_file(path: Path, data: bytes) -> KVHandoff | None:
    """Every reader entry point on ``data``: the hand-off, or None if refused cleanly."""
    path.write_bytes(data)
    with contextlib.suppress(KVHandoffError):
        bounded(lambda: parse_file_header(data, "fuzz"))
    try:
        bounded(lambda: read_header(path))
        got: KVHandoff = bounded(lambda: read_handoff(path))
    except KVHandoffError:
        return None
    assert same_as_written(got), "a damaged file was read as different KV without an error"
    return got


@given(cut=st.integers(min_value=0))
@FUZZ
def test_truncated_files_are_refused(tmp_path: Path, good_bytes: bytes, cut: int) -> None:
    cut %= len(good_bytes)  # strictly shorter
    assert check_file(tmp_path / "f", good_bytes[:cut]) is None


@given(
    flips=st.lists(
        st.tuples(st.integers(min_value=0), st.integers(min_value=1, max_value=255)),
        min_size=1,
        max_size=4,
    )
)
@FUZZ
def test_flipped_bytes_are_refused_or_harmless(
    tmp_path: Path, good_bytes: bytes, flips: list[tuple[int, int]]
) -> None:
    """A flip in tensor data fails the CRC, in token ids their digest, in the JSON header
    its parse or the shape checks; one in an informational field (request id, a digit of
    the creation time) may pass — but then the KV read is exactly the KV written."""
    data = bytearray(good_bytes)
    for pos, mask in flips:
        data[pos % len(data)] ^= mask
    check_file(tmp_path / "f", bytes(data))


def _meta_value() -> st.SearchStrategy[str]:
    """Metadata values a broken or hostile writer might put: numbers of every size and
    sign, non-numbers, JSON of the wrong shape, unicode."""
    return st.one_of(
        st.integers().map(str),
        st.integers(min_value=10**9, max_value=10**30).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.text(max_size=20),
        st.sampled_from(["", "nan", "-1", "0", "1e999", "float64", "int8", "NHD", "[]", "{}"]),
    )


def _json_value() -> st.SearchStrategy[Any]:
    return st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
        max_leaves=10,
    )


FINGERPRINT_FIELDS = sorted(json.loads(FP.to_json()))
META_KEYS = sorted(HANDOFF.header.to_metadata())


@given(
    meta_changes=st.dictionaries(st.sampled_from(META_KEYS), _meta_value(), max_size=3),
    fp_changes=st.dictionaries(
        st.sampled_from([*FINGERPRINT_FIELDS, "extra"]),
        _json_value() | st.integers(min_value=10**6, max_value=10**18),
        max_size=3,
    ),
    drop=st.sets(st.sampled_from(META_KEYS), max_size=2),
)
@FUZZ
def test_lying_metadata_is_refused(
    tmp_path: Path,
    meta_changes: dict[str, str],
    fp_changes: dict[str, Any],
    drop: set[str],
) -> None:
    """Real tensors under metadata that lies (a billion layers, a negative head count, a
    dtype that does not exist, a fingerprint that is not an object): refused, never
    believed — a declared layer count is not turned into a billion tensor names."""
    from safetensors.torch import save_file

    meta = HANDOFF.header.to_metadata()
    fingerprint = json.loads(meta["fingerprint"]) | fp_changes
    meta = {**meta, "fingerprint": json.dumps(fingerprint), **meta_changes}
    meta = {k: v for k, v in meta.items() if k not in drop}
    tensors = {"token_ids": torch.tensor(HANDOFF.token_ids)}
    for i, (k, v) in enumerate(HANDOFF.layers):
        tensors[f"k.{i}"], tensors[f"v.{i}"] = k, v
    path = tmp_path / "f"
    save_file(tensors, str(path), meta)
    check_file(path, path.read_bytes())


def _raw_file(header: Any, data_bytes: int, length_prefix: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    n = len(text) if length_prefix is None else length_prefix
    return struct.pack("<Q", n) + text + b"\0" * data_bytes


@given(
    shape=st.lists(st.integers(min_value=-1, max_value=2**40), min_size=0, max_size=4),
    offsets=st.tuples(st.integers(-1, 2**62), st.integers(-1, 2**62)),
    dtype=st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "F64", "X", ""]),
    num_layers=st.integers(min_value=-1, max_value=10**12),
    length_prefix=st.none() | st.integers(min_value=0, max_value=2**64 - 1),
)
@FUZZ
def test_huge_declared_sizes_are_not_allocated(
    tmp_path: Path,
    shape: list[int],
    offsets: tuple[int, int],
    dtype: str,
    num_layers: int,
    length_prefix: int | None,
) -> None:
    """A small file whose safetensors header declares huge tensors, offsets, layer counts
    or header length: refused within the time and memory bounds."""
    fingerprint = json.loads(FP.to_json()) | {"num_layers": num_layers}
    meta = HANDOFF.header.to_metadata() | {"fingerprint": json.dumps(fingerprint)}
    header = {
        "__metadata__": meta,
        "token_ids": {"dtype": "I64", "shape": [NUM_TOKENS], "data_offsets": [0, 56]},
        "k.0": {"dtype": dtype, "shape": shape, "data_offsets": list(offsets)},
    }
    data = _raw_file(header, 256, length_prefix)
    assert check_file(tmp_path / "f", data) is None


@given(junk=_json_value(), prefix=st.binary(max_size=16))
@FUZZ
def test_headers_that_are_not_safetensors_are_refused(
    tmp_path: Path, junk: Any, prefix: bytes
) -> None:
    assert check_file(tmp_path / "f", _raw_file(junk, 64)) is None
    assert check_file(tmp_path / "g", prefix) is None


# ----------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def kv_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, SharedDirTransport]]:
    """The prefill server's KV listener over its hand-off directory (no engine needed: it
    serves whatever bytes the directory holds)."""
    store = SharedDirTransport(tmp_path_factory.mktemp("served"))
    with serve_in_thread(create_kv_app(store)) as url:
        yield url, store


@given(
    cut=st.none() | st.integers(min_value=0),
    flips=st.lists(
        st.tuples(st.integers(min_value=0), st.integers(min_value=1, max_value=255)),
        max_size=3,
    ),
)
@settings(FUZZ, max_examples=60)
def test_pulled_bodies_are_refused_or_exact(
    tmp_path: Path,
    good_bytes: bytes,
    kv_server: tuple[str, SharedDirTransport],
    cut: int | None,
    flips: list[tuple[int, int]],
) -> None:
    """The ``http`` transport's header (range request) and download of a damaged file:
    a KVHandoffError, or exactly the KV written — read as the worker reads it, without a
    CRC check of its own, so the download's check is what guards it; no partial file left
    in the cache."""
    url, store = kv_server
    data = bytearray(good_bytes if cut is None else good_bytes[: cut % len(good_bytes)])
    for pos, mask in flips:
        if data:
            data[pos % len(data)] ^= mask
    store.path("x").write_bytes(bytes(data))
    cache = tmp_path / "cache"
    for leftover in cache.glob("*") if cache.exists() else ():
        leftover.unlink()
    transport = HTTPPullTransport(cache, timeout_s=2.0, header_timeout_s=2.0, max_bytes=1 << 20)
    ref = HandoffRef("x", source=url)
    try:
        try:
            bounded(lambda: transport.header(ref))
            with transport.open(ref) as reader:
                got = reader.read_all(verify_checksum=False)
        except KVHandoffError:
            assert [p.name for p in cache.iterdir()] in ([], ["x.kv.safetensors"])
            return
        assert same_as_written(got)
    finally:
        transport.close()


def test_endless_body_is_cut_at_max_bytes(
    tmp_path: Path, kv_server: tuple[str, SharedDirTransport], good_bytes: bytes
) -> None:
    """A served file far larger than ``max_bytes`` (a header declaring it or not): the
    download stops at the limit, nothing is kept."""
    url, store = kv_server
    store.path("big").write_bytes(good_bytes + b"\0" * (4 << 20))
    transport = HTTPPullTransport(tmp_path / "c", max_bytes=1 << 20)
    try:
        with pytest.raises(KVHandoffError, match="exceeds max_bytes"):
            transport.open(HandoffRef("big", source=url))
        assert list(transport.root.iterdir()) == []
    finally:
        transport.close()


# ----------------------------------------------------------------- decode recomputes


def _damaged(good: bytes) -> dict[str, bytes]:
    lying = json.loads(HANDOFF.header.to_metadata()["fingerprint"]) | {"num_layers": 10**9}
    meta = HANDOFF.header.to_metadata() | {"fingerprint": json.dumps(lying)}
    text = good[8 : 8 + struct.unpack("<Q", good[:8])[0]]
    header = json.loads(text) | {"__metadata__": meta}
    flipped = bytearray(good)
    flipped[20] ^= 0x55  # inside the JSON header
    return {
        "truncated": good[: len(good) // 2],
        "lying": _raw_file(header, len(good) - 8 - len(text)),
        "flipped": bytes(flipped),
        "empty": b"",
    }


@pytest.mark.parametrize("kind", ["truncated", "lying", "flipped", "empty"])
def test_decode_recomputes_when_the_handoff_is_refused(
    tmp_path: Path, good_bytes: bytes, kind: str
) -> None:
    """vLLM's scheduler asks the connector how many prompt tokens the hand-off covers: for
    a refused file, none (the prompt is recomputed), and the finished request reports
    ``recomputed`` with the reason."""
    pytest.importorskip("vllm")
    from tests.kv.test_connector_scheduler import make_connector, matched, request

    prompt = [*HANDOFF.token_ids, 42]
    SharedDirTransport(tmp_path).path("h1").write_bytes(_damaged(good_bytes)[kind])
    conn = make_connector(tmp_path)
    conn._expected = FP
    req = request("a", prompt, HandoffRef("h1").to_params())
    assert matched(conn, req) == (0, False)
    _, out = conn.request_finished(req, [])
    assert out["flowprefill"]["status"] == "recomputed"
    assert "KVFormatError" in out["flowprefill"]["reason"]
    # the intact file is loaded: the refusal above came from the damage
    SharedDirTransport(tmp_path).path("h2").write_bytes(good_bytes)
    ok = request("b", prompt, HandoffRef("h2").to_params())
    assert matched(conn, ok) == (NUM_TOKENS, False)


def test_a_flipped_tensor_byte_is_refused_at_download(
    tmp_path: Path, good_bytes: bytes, kv_server: tuple[str, SharedDirTransport]
) -> None:
    """The last byte of the file is tensor data: a flip there passes every structural
    check, and only the CRC-32 the download verifies catches it (unchecked, it is loaded)."""
    url, store = kv_server
    data = bytearray(good_bytes)
    data[-1] ^= 0x01
    store.path("flip").write_bytes(bytes(data))
    ref = HandoffRef("flip", source=url)
    unchecked = HTTPPullTransport(tmp_path / "a", verify_checksum=False)
    checked = HTTPPullTransport(tmp_path / "b")
    try:
        with unchecked.open(ref) as reader:
            assert not same_as_written(reader.read_all(verify_checksum=False))
        with pytest.raises(KVFormatError, match="CRC-32"):
            checked.open(ref)
        assert list((tmp_path / "b").iterdir()) == []  # nothing kept
    finally:
        unchecked.close()
        checked.close()
