"""The producer's side channel, spoken to as vLLM's consumer does (a ZMQ REQ socket)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from flowprefill.contracts.nixl import GET_META_MSG
from flowprefill.kv.nixl.side_channel import SideChannel

PAYLOAD = b"\x82payload-for-rank-0"
TIMEOUT_MS = 300


@pytest.fixture
def channel() -> Iterator[SideChannel]:
    ch = SideChannel("127.0.0.1", 0, {(0, 0): PAYLOAD, (0, 1): b"rank-1"})
    yield ch
    ch.close()


def ask(port: int, body: bytes, timeout_ms: int = TIMEOUT_MS) -> list[bytes] | None:
    """One request on a fresh REQ socket (a REQ that timed out cannot send again);
    None when no answer came in ``timeout_ms``."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(body)
        try:
            return sock.recv_multipart()
        except zmq.Again:
            return None
    finally:
        sock.close()


def get_meta(pp_rank: Any = 0, tp_rank: Any = 0, message: Any = GET_META_MSG) -> bytes:
    return msgspec.msgpack.encode((message, pp_rank, tp_rank))


def test_answers_vllms_request_with_two_frames(channel: SideChannel) -> None:
    assert GET_META_MSG == b"get_meta_msg"
    before = time.perf_counter()
    reply = ask(channel.port, get_meta(0, 0), timeout_ms=5000)
    after = time.perf_counter()
    assert reply is not None and len(reply) == 2
    assert reply[0] == PAYLOAD
    stamp = msgspec.msgpack.decode(reply[1])
    assert isinstance(stamp, float)
    assert before <= stamp <= after  # the producer's perf_counter (same process here)
    assert channel.handshakes == 1
    reply = ask(channel.port, get_meta(0, 1), timeout_ms=5000)
    assert reply is not None and reply[0] == b"rank-1"
    assert channel.handshakes == 2


def test_one_req_socket_can_ask_every_rank_in_turn(channel: SideChannel) -> None:
    """vLLM's consumer reuses one REQ socket for all remote ranks."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        sock.connect(f"tcp://127.0.0.1:{channel.port}")
        for rank, want in ((0, PAYLOAD), (1, b"rank-1"), (0, PAYLOAD)):
            sock.send(get_meta(0, rank))
            frames = sock.recv_multipart()
            assert len(frames) == 2 and frames[0] == want
    finally:
        sock.close()


@pytest.mark.parametrize(
    "body",
    [
        get_meta(0, 2),  # a rank we do not serve
        get_meta(1, 0),  # a pipeline rank we do not serve
        get_meta(0, 0, message=b"get_other_msg"),
        get_meta(0, 0, message="get_meta_msg"),  # str, not bytes
        msgspec.msgpack.encode((GET_META_MSG, 0)),  # two fields
        msgspec.msgpack.encode(7),
        b"\xc1 not msgpack",
    ],
    ids=["tp-rank", "pp-rank", "message", "str-message", "short", "int", "garbage"],
)
def test_bad_requests_get_no_answer_and_the_channel_lives_on(
    channel: SideChannel, body: bytes
) -> None:
    assert ask(channel.port, body) is None
    assert channel.handshakes == 0
    reply = ask(channel.port, get_meta(0, 0), timeout_ms=5000)
    assert reply is not None and reply[0] == PAYLOAD


def test_unhashable_rank_does_not_kill_the_channel(channel: SideChannel) -> None:
    assert ask(channel.port, get_meta([0], 0)) is None
    reply = ask(channel.port, get_meta(0, 0), timeout_ms=1000)
    assert reply is not None and reply[0] == PAYLOAD


def test_a_multi_frame_message_is_ignored(channel: SideChannel) -> None:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    try:
        sock.connect(f"tcp://127.0.0.1:{channel.port}")
        sock.send_multipart([get_meta(0, 0), b"extra"])
        with pytest.raises(zmq.Again):
            sock.recv_multipart()
    finally:
        sock.close()
    reply = ask(channel.port, get_meta(0, 0), timeout_ms=5000)
    assert reply is not None and reply[0] == PAYLOAD


def test_port_zero_picks_a_port(channel: SideChannel) -> None:
    assert 0 < channel.port < 65536
    other = SideChannel("127.0.0.1", 0, {(0, 0): b"other"})
    try:
        assert other.port != channel.port
        reply = ask(other.port, get_meta(), timeout_ms=5000)
        assert reply is not None and reply[0] == b"other"
    finally:
        other.close()


def test_close_stops_answering() -> None:
    ch = SideChannel("127.0.0.1", 0, {(0, 0): PAYLOAD})
    assert ask(ch.port, get_meta(), timeout_ms=5000) is not None
    ch.close()
    assert not ch._thread.is_alive()
    assert ask(ch.port, get_meta()) is None
    # the port is free again
    again = SideChannel("127.0.0.1", ch.port, {(0, 0): b"again"})
    try:
        reply = ask(again.port, get_meta(), timeout_ms=5000)
        assert reply is not None and reply[0] == b"again"
    finally:
        again.close()


def test_a_taken_port_raises_oserror_naming_it(channel: SideChannel) -> None:
    with pytest.raises(OSError, match=f"127.0.0.1:{channel.port}"):
        SideChannel("127.0.0.1", channel.port, {(0, 0): b"x"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=str(port)):
            SideChannel("127.0.0.1", port, {(0, 0): b"x"})
    # the first channel is unaffected
    reply = ask(channel.port, get_meta(), timeout_ms=5000)
    assert reply is not None and reply[0] == PAYLOAD
