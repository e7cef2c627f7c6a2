"""NixlProducer with a real NIXL (UCX) agent: the handshake as vLLM decodes it, publishing,
leases freed by NIXL notifications, and a real NIXL READ of a published block."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import torch
import zmq

from flowprefill.contracts.nixl import GET_META_MSG, RemotePrefill, compatibility_hash
from flowprefill.errors import KVHandoffError
from flowprefill.kv.nixl.layout import PageLayout
from flowprefill.kv.nixl.leases import Leases
from flowprefill.kv.nixl.pool import BlockPool, PoolExhaustedError
from flowprefill.kv.nixl.producer import NixlProducer, ServedModel

nixl_api: Any = pytest.importorskip("nixl._api")

HEADS, DIM, BLOCK, LAYERS, BLOCKS = 2, 32, 32, 2, 6
MODEL = ServedModel("/models/demo", LAYERS, HEADS, DIM, torch.float32)


def _layout() -> PageLayout:
    return PageLayout("CPU_ATTN", HEADS, DIM, BLOCK, torch.float32)


def _layers(tokens: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(HEADS, tokens, DIM, generator=gen),
            torch.randn(HEADS, tokens, DIM, generator=gen),
        )
        for _ in range(LAYERS)
    ]


@pytest.fixture
def producer() -> Iterator[NixlProducer]:
    layout = _layout()
    p = NixlProducer(MODEL, layout, BlockPool(layout, LAYERS, BLOCKS))
    yield p
    p.close()


@pytest.fixture
def peer() -> Iterator[Any]:
    """A second NIXL agent in this process, standing in for a vLLM consumer."""
    agent = nixl_api.nixl_agent(
        f"peer-{uuid.uuid4()}", nixl_api.nixl_agent_config(backends=["UCX"])
    )
    yield agent


def _connect(peer: Any, producer: NixlProducer) -> str:
    name = peer.add_remote_agent(producer.agent_metadata()["agent_metadata"])
    name = name.decode() if isinstance(name, bytes) else str(name)
    assert name == producer.agent_name
    return name


def _wait(condition: Callable[[], bool], producer: NixlProducer, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        producer.poll()
        time.sleep(0.02)


def _handshake(port: int) -> list[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        return sock.recv_multipart()
    finally:
        sock.close()


# ------------------------------------------------------------------ handshake


def test_handshake_decodes_with_vllms_classes(producer: NixlProducer) -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlHandshakePayload,
    )

    frames = _handshake(producer.port)
    assert len(frames) == 2
    assert isinstance(msgspec.msgpack.decode(frames[1]), float)
    payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(frames[0])
    assert payload.compatibility_hash == producer.compatibility_hash()
    assert payload.compatibility_hash == compatibility_hash(
        model="/models/demo",
        dtype="torch.float32",
        num_kv_heads=HEADS,
        head_size=DIM,
        num_layers=LAYERS,
        attn_backend="CPU_ATTN",
    )
    meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)

    # every field of vLLM's metadata is sent (none falls back to a default silently)
    ours = producer.agent_metadata()
    assert set(ours) == {f.name for f in dataclasses.fields(NixlAgentMetadata)}
    for name, value in ours.items():
        got = getattr(meta, name)
        assert got == (tuple(value) if name == "ssm_sizes" else value), name

    pool, layout = producer.pool, producer.layout
    assert meta.engine_id == producer.engine_id
    assert meta.kv_caches_base_addr == pool.region_addresses()
    assert meta.block_lens == [layout.block_bytes] * LAYERS
    assert meta.block_strides == [layout.block_bytes] * LAYERS
    assert meta.num_blocks == BLOCKS and meta.region_num_blocks == [BLOCKS] * LAYERS
    assert meta.block_size == BLOCK
    assert meta.kv_cache_layout == "LBHNC"
    assert meta.attn_backend_name == "CPU_ATTN"
    assert meta.region_mem_types == ["DRAM"] * LAYERS
    assert meta.device_id == 0
    assert meta.physical_blocks_per_logical_kv_block == 1
    assert meta.agent_metadata == ours["agent_metadata"] and len(meta.agent_metadata) > 0


def test_fresh_engine_id_per_producer(producer: NixlProducer) -> None:
    layout = _layout()
    other = NixlProducer(MODEL, layout, BlockPool(layout, LAYERS, 2))
    try:
        assert other.engine_id != producer.engine_id
        assert other.agent_name != producer.agent_name
        assert other.port != producer.port
        assert other.agent_metadata()["engine_id"] == other.engine_id
    finally:
        other.close()


# ------------------------------------------------------------------ publishing


@pytest.mark.parametrize(
    ("tokens", "consumer_tokens", "blocks"),
    [(40, 40, 2), (40, 41, 2), (64, 64, 2), (64, 65, 3), (1, 1, 1), (31, 96, 3)],
)
def test_publish_lists_the_blocks_the_consumer_prompt_needs(
    producer: NixlProducer, tokens: int, consumer_tokens: int, blocks: int
) -> None:
    layers = _layers(tokens)
    answer = producer.publish("req-1", layers, consumer_tokens)
    assert len(answer.block_ids) == blocks
    assert answer.request_id == "req-1" and answer.handoff_id == "req-1"
    assert answer.engine_id == producer.engine_id
    assert (answer.host, answer.port) == ("127.0.0.1", producer.port)
    assert answer.num_tokens == tokens and answer.tp_size == 1
    assert "req-1" in producer.leases
    assert producer.pool.free_blocks == BLOCKS - blocks
    ids = list(answer.block_ids)
    for layer, (key, value) in enumerate(layers):
        k, v = producer.layout.unpack(producer.pool.buffer[layer][ids], tokens)
        assert torch.equal(k, key) and torch.equal(v, value)
    # what a decode request carries round-trips
    assert RemotePrefill.from_params(answer.to_params()) == answer


def test_publish_accepts_batched_kv(producer: NixlProducer) -> None:
    layers = [(k[None], v[None]) for k, v in _layers(33)]
    answer = producer.publish("r", layers, 33)
    assert answer.num_tokens == 33 and len(answer.block_ids) == 2


def test_publish_refuses_a_shorter_consumer_prompt(producer: NixlProducer) -> None:
    with pytest.raises(KVHandoffError, match="decode prompt of 39 < 40 KV tokens"):
        producer.publish("r", _layers(40), 39)
    assert producer.pool.free_blocks == BLOCKS and "r" not in producer.leases


def test_pool_too_small_leaves_nothing_behind(producer: NixlProducer) -> None:
    producer.publish("a", _layers(96), 96)  # 3 of 6 blocks
    with pytest.raises(PoolExhaustedError):
        producer.publish("b", _layers(100), 100)  # 4 blocks
    assert "b" not in producer.leases and len(producer.leases) == 1
    assert producer.pool.free_blocks == 3
    producer.publish("c", _layers(96), 96)  # the other 3 are still usable
    assert producer.pool.free_blocks == 0


def test_a_failed_write_releases_its_blocks(producer: NixlProducer) -> None:
    with pytest.raises(KVHandoffError, match="1 layers for a pool of 2"):
        producer.publish("r", _layers(40)[:1], 40)
    assert producer.pool.free_blocks == BLOCKS and "r" not in producer.leases


def test_discard_frees(producer: NixlProducer) -> None:
    producer.publish("r", _layers(40), 40)
    assert producer.pool.free_blocks == BLOCKS - 2
    assert producer.discard("r") is True
    assert producer.pool.free_blocks == BLOCKS and "r" not in producer.leases
    assert producer.discard("r") is False


def test_republishing_an_id_frees_the_first_blocks(producer: NixlProducer) -> None:
    producer.publish("r", _layers(96), 96)
    producer.publish("r", _layers(40), 40)
    assert producer.pool.free_blocks == BLOCKS - 2 and len(producer.leases) == 1


# ------------------------------------------------------------------ notifications


def test_read_notification_frees_the_lease(producer: NixlProducer, peer: Any) -> None:
    name = _connect(peer, producer)
    producer.publish("req-a", _layers(40), 40)
    producer.publish("req-b", _layers(10), 10)
    peer.send_notif(name, b"req-a:1")
    _wait(lambda: "req-a" not in producer.leases, producer)
    assert "req-b" in producer.leases
    assert producer.pool.free_blocks == BLOCKS - 1
    assert producer.leases.completed_total == 1


def test_read_notification_waits_for_every_consumer(producer: NixlProducer, peer: Any) -> None:
    name = _connect(peer, producer)
    producer.publish("req:with:colons", _layers(40), 40)
    producer.publish("marker", _layers(1), 1)
    peer.send_notif(name, b"req:with:colons:2")
    peer.send_notif(name, b"marker:1")  # sent after: once it is handled, so is the first
    _wait(lambda: "marker" not in producer.leases, producer)
    assert "req:with:colons" in producer.leases  # one of two consumers done
    peer.send_notif(name, b"req:with:colons:2")
    _wait(lambda: "req:with:colons" not in producer.leases, producer)
    assert producer.pool.free_blocks == BLOCKS


def test_bad_notifications_are_ignored(producer: NixlProducer, peer: Any) -> None:
    name = _connect(peer, producer)
    producer.publish("r", _layers(40), 40)
    for junk in (b"no-count", b"r:x", b"\xff\xfe", b"unknown:1", b"HB:", b"HB:ghost,,"):
        peer.send_notif(name, junk)
    peer.send_notif(name, b"r:1")
    _wait(lambda: "r" not in producer.leases, producer)
    assert producer.pool.free_blocks == BLOCKS
    assert producer._thread.is_alive()  # the watcher survived


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_heartbeat_notification_extends_the_lease(producer: NixlProducer, peer: Any) -> None:
    clock = FakeClock()
    producer.leases = Leases(producer.pool.release, 30.0, clock=clock)
    name = _connect(peer, producer)
    producer.publish("beating", _layers(40), 40)
    producer.publish("silent", _layers(10), 10)
    producer.publish("marker", _layers(1), 1)
    clock.now = 20.0
    peer.send_notif(name, b"HB:beating,ghost")  # to 20 + 2/3 * 30 = 40
    peer.send_notif(name, b"marker:1")
    _wait(lambda: "marker" not in producer.leases, producer)
    clock.now = 35.0
    _wait(lambda: "silent" not in producer.leases, producer)  # expired at 30
    producer.poll()
    assert "beating" in producer.leases
    clock.now = 40.0
    _wait(lambda: "beating" not in producer.leases, producer)
    assert producer.pool.free_blocks == BLOCKS
    assert producer.leases.expired_total == 2


# ------------------------------------------------------------------ a real NIXL READ


def test_peer_reads_published_blocks_over_nixl(producer: NixlProducer, peer: Any) -> None:
    _read_published_blocks(producer, peer)


def test_reads_and_notifications_need_no_progress_thread(peer: Any) -> None:
    """On CPU the producer runs without NIXL's progress thread; its notification poll
    progresses the agent, and a consumer's READ still completes and ends the lease."""
    layout = _layout()
    polled = NixlProducer(MODEL, layout, BlockPool(layout, LAYERS, BLOCKS), progress_thread=False)
    try:
        _read_published_blocks(polled, peer)
    finally:
        polled.close()


def _busy_cpu_s(progress_thread: bool, seconds: float = 1.0) -> float:
    """CPU time this process spends while an idle producer exists for ``seconds``."""
    layout = _layout()
    p = NixlProducer(MODEL, layout, BlockPool(layout, LAYERS, 2), progress_thread=progress_thread)
    try:
        time.sleep(0.2)  # past start-up
        start = time.process_time()
        time.sleep(seconds)
        return time.process_time() - start
    finally:
        p.close()


def test_an_idle_producer_without_progress_thread_leaves_the_cpu_alone() -> None:
    """NIXL's progress thread polls without sleeping (a core for the life of the process,
    which on a CPU host is prefill's); without it an idle producer only wakes to read
    notifications."""
    polled = _busy_cpu_s(progress_thread=False)
    spinning = _busy_cpu_s(progress_thread=True)
    assert polled < 0.2, f"idle producer used {polled:.2f} s of CPU in 1 s"
    assert spinning > 2 * polled, (spinning, polled)


def _read_published_blocks(producer: NixlProducer, peer: Any) -> None:
    tokens = 70  # 3 blocks, the last one partly filled
    layers = _layers(tokens, seed=3)
    answer = producer.publish("read-me", layers, tokens)
    name = _connect(peer, producer)
    meta = producer.agent_metadata()
    block_len = meta["block_lens"][0]
    ids = list(answer.block_ids)
    # like vLLM's consumer: one descriptor per (layer, block) at base + id * block_len
    dst = torch.zeros(LAYERS, len(ids), producer.layout.block_elements)
    peer.register_memory(peer.get_reg_descs(dst))
    local = peer.get_xfer_descs(
        [
            (dst[layer, i].data_ptr(), block_len, 0)
            for layer in range(LAYERS)
            for i in range(len(ids))
        ],
        "DRAM",
    )
    remote = peer.get_xfer_descs(
        [
            (meta["kv_caches_base_addr"][layer] + b * block_len, block_len, meta["device_id"])
            for layer in range(LAYERS)
            for b in ids
        ],
        "DRAM",
    )
    handle = peer.initialize_xfer("READ", local, remote, name, b"read-me:1")
    state = peer.transfer(handle)
    assert state != "ERR"
    deadline = time.monotonic() + 10
    while (state := peer.check_xfer_state(handle)) != "DONE":
        assert state != "ERR" and time.monotonic() < deadline, state
        time.sleep(0.005)
    peer.release_xfer_handle(handle)

    # byte for byte (compared as integers: the unfilled tail of the last block may hold
    # NaN bit patterns, see test_pool.py::test_write_leaves_the_unfilled_tail_as_it_was)
    mine = producer.pool.buffer[:, ids]
    assert torch.equal(dst.view(torch.int32), mine.view(torch.int32))
    for layer, (key, value) in enumerate(layers):
        k, v = producer.layout.unpack(dst[layer], tokens)
        assert torch.equal(k, key) and torch.equal(v, value)
    # the transfer's notification ("<id>:1", as vLLM's consumer sends) ends the lease
    _wait(lambda: "read-me" not in producer.leases, producer)
    assert producer.pool.free_blocks == BLOCKS


def test_close_stops_the_side_channel_and_watcher() -> None:
    layout = _layout()
    p = NixlProducer(MODEL, layout, BlockPool(layout, LAYERS, 2))
    p.close()
    assert not p._thread.is_alive()
    assert not p.side_channel._thread.is_alive()
