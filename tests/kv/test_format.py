"""The hand-off format, transport and request params, without vLLM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from flowprefill.contracts.kv import HandoffRef, result_params
from flowprefill.errors import KVFormatError, KVHandoffError, KVMismatchError, KVNotFoundError
from flowprefill.kv import (
    KVReader,
    ModelFingerprint,
    SharedDirTransport,
    build_handoff,
    check_prompt,
    load_end,
    make_transport,
    num_tokens_to_load,
    read_handoff,
    read_header,
    write_handoff,
)
from flowprefill.kv.format import KVHandoff

FP = ModelFingerprint(
    model_type="llama", num_layers=2, num_kv_heads=2, head_dim=8, hidden_size=32, vocab_size=100
)


def make_layers(
    num_tokens: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (FP.num_kv_heads, num_tokens, FP.head_dim)
    return [
        (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for _ in range(FP.num_layers)
    ]


def make_handoff(num_tokens: int = 7, dtype: torch.dtype = torch.float32) -> KVHandoff:
    return build_handoff(
        make_layers(num_tokens, dtype), list(range(3, 3 + num_tokens)), FP, "r1", first_token_id=42
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    handoff = make_handoff(dtype=dtype)
    path = write_handoff(handoff, tmp_path / "a.kv.safetensors")
    back = read_handoff(path)
    assert back.header == handoff.header
    assert back.token_ids == handoff.token_ids
    for (k0, v0), (k1, v1) in zip(handoff.layers, back.layers, strict=True):
        assert k1.dtype == dtype and torch.equal(k0, k1) and torch.equal(v0, v1)
    header = read_header(path)
    assert (header.num_tokens, header.first_token_id, header.request_id) == (7, 42, "r1")
    assert header.fingerprint == FP


def test_layer_range_reads_a_slice(tmp_path: Path) -> None:
    handoff = make_handoff(10)
    with KVReader(write_handoff(handoff, tmp_path / "a")) as reader:
        key, value = reader.layer(1, 3, 8)
    assert torch.equal(key, handoff.layers[1][0][:, 3:8])
    assert torch.equal(value, handoff.layers[1][1][:, 3:8])
    with KVReader(tmp_path / "a") as reader, pytest.raises(KVMismatchError):
        reader.layer(2)


def test_batch_dim_of_one_is_dropped() -> None:
    layers = [(k[None], v[None]) for k, v in make_layers(4)]
    assert build_handoff(layers, [5, 6, 7, 8], FP).layers[0][0].shape == (2, 4, 8)


@pytest.mark.parametrize(
    ("layers", "ids", "field"),
    [
        (make_layers(4)[:1], [1, 2, 3, 4], "num_layers"),
        (make_layers(4), [1, 2, 3], "layer 0 key shape"),
        ([(k[:1], v[:1]) for k, v in make_layers(4)], [1, 2, 3, 4], "layer 0 key shape"),
        ([(k, v.half()) for k, v in make_layers(4)], [1, 2, 3, 4], "layer 0 value dtype"),
        (make_layers(4), [], "num_tokens"),
    ],
)
def test_build_rejects_bad_producer_output(
    layers: list[tuple[torch.Tensor, torch.Tensor]], ids: list[int], field: str
) -> None:
    with pytest.raises(KVMismatchError) as err:
        build_handoff(layers, ids, FP)
    assert err.value.field.startswith(field)
    assert field.split()[0] in str(err.value)


def test_truncated_file_is_a_format_error(tmp_path: Path) -> None:
    path = write_handoff(make_handoff(), tmp_path / "a")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    with pytest.raises(KVFormatError, match="unreadable"):
        read_header(path)


def test_flipped_data_byte_fails_checksum(tmp_path: Path) -> None:
    path = write_handoff(make_handoff(), tmp_path / "a")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # inside the last tensor's data
    path.write_bytes(bytes(data))
    read_header(path)  # the header is intact
    with pytest.raises(KVFormatError, match="CRC-32"):
        read_handoff(path)
    read_handoff(path, verify_checksum=False)


def test_foreign_and_future_files_are_rejected(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "foreign"))
    with pytest.raises(KVFormatError, match="not a flowprefill-kv file"):
        read_header(tmp_path / "foreign")
    handoff = make_handoff()
    meta = handoff.header.to_metadata() | {"version": "99"}
    save_file({"token_ids": torch.zeros(7, dtype=torch.int64)}, str(tmp_path / "v99"), meta)
    with pytest.raises(KVFormatError, match="version '99'"):
        read_header(tmp_path / "v99")


def test_header_that_lies_about_shapes_is_rejected(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    handoff = make_handoff(7)
    tensors = {"token_ids": torch.arange(7)}
    for i, (k, v) in enumerate(handoff.layers):
        tensors[f"k.{i}"], tensors[f"v.{i}"] = k[:, :5].contiguous(), v[:, :5].contiguous()
    save_file(tensors, str(tmp_path / "a"), handoff.header.to_metadata())
    with pytest.raises(KVFormatError, match=r"header says float32\[2, 7, 8\]"):
        read_header(tmp_path / "a")
    del tensors["v.1"]
    save_file(tensors, str(tmp_path / "b"), handoff.header.to_metadata())
    with pytest.raises(KVFormatError, match="missing"):
        read_header(tmp_path / "b")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(KVNotFoundError):
        read_header(tmp_path / "nope")


def test_check_prompt() -> None:
    header = make_handoff(4).header
    check_prompt(header, [3, 4, 5, 6])
    check_prompt(header, [3, 4, 5, 6, 99])  # prompt + first token
    with pytest.raises(KVMismatchError, match="token ids"):
        check_prompt(header, [3, 4, 5, 7, 99])
    with pytest.raises(KVMismatchError, match="num_tokens"):
        check_prompt(header, [3, 4, 5])


def test_fingerprint_mismatch_names_the_field() -> None:
    other = ModelFingerprint(**{**FP.__dict__, "head_dim": 16})
    with pytest.raises(KVMismatchError, match="model head_dim mismatch: expected 16, found 8"):
        FP.check_matches(other)
    FP.check_matches(ModelFingerprint(**{**FP.__dict__, "rope_theta": 1e4}))  # unknown: skip


def test_fingerprint_from_hf_config() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        vocab_size=500,
        intermediate_size=128,
    )
    fp = ModelFingerprint.from_config(config)
    assert (fp.num_layers, fp.num_kv_heads, fp.head_dim, fp.model_type) == (3, 2, 16, "llama")
    assert fp.rope_theta is not None
    assert ModelFingerprint.from_json(fp.to_json()) == fp


def test_shared_dir_transport(tmp_path: Path) -> None:
    transport = SharedDirTransport(tmp_path / "store")
    handoff = make_handoff()
    transport.put("req-1", handoff)
    assert transport.header("req-1") == handoff.header
    with transport.open("req-1") as reader:
        assert reader.token_ids() == handoff.token_ids
    assert [p.name for p in (tmp_path / "store").iterdir()] == ["req-1.kv.safetensors"]
    assert transport.delete("req-1") and not transport.delete("req-1")
    with pytest.raises(KVNotFoundError):
        transport.header("req-1")


def test_transport_sweeps_old_handoffs(tmp_path: Path) -> None:
    transport = SharedDirTransport(tmp_path)
    transport.put("old", make_handoff())
    transport.put("new", make_handoff())
    os.utime(transport.path("old"), (1000.0, 1000.0))
    assert transport.sweep(max_age_s=60) == 1
    assert transport.header("new")


def test_transport_sweeps_what_a_killed_writer_left(tmp_path: Path) -> None:
    """A prefill killed mid-write leaves its temp file; the age sweep removes it too."""
    transport = SharedDirTransport(tmp_path)
    final = transport.path("req-1")
    stale = final.with_name(f".{final.name}.4242.tmp")
    fresh = final.with_name(f".{final.name}.4343.tmp")  # being written right now
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(stale, (1000.0, 1000.0))
    assert transport.sweep(max_age_s=60) == 1
    assert not stale.exists() and fresh.exists()


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden", "-x", "a..b", "x" * 129, "a b"])
def test_handoff_ids_are_safe_file_names(tmp_path: Path, bad: str) -> None:
    with pytest.raises(KVHandoffError):
        SharedDirTransport(tmp_path).path(bad)


def test_make_transport(tmp_path: Path) -> None:
    assert isinstance(make_transport("shared_dir", path=str(tmp_path)), SharedDirTransport)
    with pytest.raises(KVHandoffError, match="unknown KV transport"):
        make_transport("nixl")


def test_default_storage_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowprefill.kv.transport import default_storage_path

    monkeypatch.setenv("FLOWPREFILL_KV_DIR", str(tmp_path / "kv"))
    assert default_storage_path() == str(tmp_path / "kv")
    transport = make_transport("shared_dir")
    assert isinstance(transport, SharedDirTransport) and transport.root == tmp_path / "kv"
    monkeypatch.delenv("FLOWPREFILL_KV_DIR")
    assert default_storage_path() == "/tmp/flowprefill-kv"


def test_params_round_trip() -> None:
    ref = HandoffRef("abc", num_tokens=12)
    params = ref.to_params()
    assert params == {"flowprefill": {"version": 1, "handoff_id": "abc", "num_tokens": 12}}
    assert HandoffRef.from_params(params) == ref
    assert HandoffRef.from_params(None) is None
    assert HandoffRef.from_params({"do_remote_prefill": True}) is None
    assert result_params(ref, 12)["flowprefill"]["status"] == "loaded"
    assert result_params(ref, 0, "gone")["flowprefill"] == {
        "handoff_id": "abc",
        "loaded_tokens": 0,
        "status": "recomputed",
        "reason": "gone",
    }


@pytest.mark.parametrize(
    "body",
    [
        {"flowprefill": "abc"},
        {"flowprefill": {"handoff_id": "../etc"}},
        {"flowprefill": {"handoff_id": "a", "version": 2}},
        {"flowprefill": {"handoff_id": "a", "num_tokens": 0}},
    ],
)
def test_bad_params(body: dict[str, object]) -> None:
    with pytest.raises(KVHandoffError):
        HandoffRef.from_params(body)


def test_load_arithmetic() -> None:
    # gateway sends prompt + [first token]: the whole 300-token prompt comes from the KV
    assert load_end(300, 301) == 300
    # bare prompt: vLLM must compute the last token itself
    assert load_end(300, 300) == 299
    # KV longer than the request is never over-used
    assert load_end(300, 10) == 9
    # vLLM's prefix cache already holds 256 tokens: load the rest only
    assert num_tokens_to_load(300, 301, 256) == 44
    assert num_tokens_to_load(300, 301, 300) == 0
