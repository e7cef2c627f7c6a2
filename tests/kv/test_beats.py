"""Decode beats: the wire format, the fire-and-forget sender, the listener and the decode
state the engine's decode-aware yield reads."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from flowprefill.contracts.beats import SOCKET_KEY, beat_connector_config, socket_paths, with_beats
from flowprefill.kv.beats import (
    END,
    GAP,
    MAX_DATAGRAM,
    MEAN,
    START,
    Beat,
    BeatListener,
    BeatSender,
    DecodeState,
    decode,
    encode,
)


def test_round_trip() -> None:
    data = encode(END, 7, 12.5, ["cmpl-a-0", "cmpl-b-0"])
    assert decode(data) == Beat(END, 7, 12.5, 2, ("cmpl-a-0", "cmpl-b-0"))
    assert decode(encode(START, 1, 0.25, [])) == Beat(START, 1, 0.25, 0, ())


def test_many_ids_are_cut_but_counted() -> None:
    ids = [f"cmpl-{i:06d}-0" for i in range(10_000)]  # ~150 KB of ids
    data = encode(END, 1, 1.0, ids)
    assert len(data) <= MAX_DATAGRAM
    beat = decode(data)
    assert beat.num_decoding == 10_000
    assert 0 < len(beat.req_ids) < 10_000
    assert list(beat.req_ids) == ids[: len(beat.req_ids)]  # whole ids only


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"FPB1", "shorter"),
        (b"XXXX" + encode(START, 1, 1.0, [])[4:], "magic"),
        (encode(START, 1, 1.0, [])[:4] + b"\x05" + encode(START, 1, 1.0, [])[5:], "kind"),
        (encode(START, 1, math.nan, []), "not finite"),
    ],
)
def test_bad_datagrams_are_named(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode(data)


def test_encode_refuses_unknown_kind() -> None:
    with pytest.raises(ValueError, match="START"):
        encode(3, 1, 1.0, [])


def test_sender_without_listener_drops_silently(tmp_path: Path) -> None:
    sender = BeatSender(str(tmp_path / "nobody.sock"))
    t0 = time.perf_counter()
    for step in range(100):
        sender.send(START, step, ["r"])
    took = time.perf_counter() - t0
    assert sender.sent == 0 and sender.dropped == 100
    assert took < 0.5  # non-blocking: never waits for a listener
    sender.close()


def test_socket_paths() -> None:
    assert socket_paths("/a") == ("/a",)
    assert socket_paths(["/a", "/b"]) == ("/a", "/b")
    for bad in (None, "", [], ["/a", ""], 3):
        with pytest.raises(ValueError, match=SOCKET_KEY):
            socket_paths(bad)


def test_listener_folds_beats_in_order(tmp_path: Path) -> None:
    state = DecodeState(0.1)
    path = str(tmp_path / "beats.sock")
    listener = BeatListener(path, state)
    try:
        sender = BeatSender([path, str(tmp_path / "absent.sock")])
        sender.send(START, 1, ["a"])
        sender.send(END, 1, ["a"])
        assert state.wait_end(0, 5.0)
        assert state.end_count == 1 and not state.in_step and state.active
        assert state.num_decoding == 1
        assert state.next_deadline_s == pytest.approx(state.last_end_s + 0.1)
        assert sender.sent == 2 and sender.dropped == 2
        sender.send(START, 2, [])
        sender.send(END, 2, [])
        assert state.wait_end(1, 5.0)
        assert not state.active and state.next_deadline_s == math.inf
        # Garbage is counted and ignored, the listener goes on.
        listener._sock.sendto(b"junk", path)  # its own socket can send to its own path
        sender.send(START, 3, ["b"])
        deadline = time.monotonic() + 5
        while state.beats < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state.bad_beats == 1 and state.in_step
    finally:
        listener.close()
    assert not Path(path).exists()


def test_listener_replaces_a_stale_socket(tmp_path: Path) -> None:
    path = tmp_path / "beats.sock"
    path.write_text("left by a previous engine")
    listener = BeatListener(path, DecodeState(0.1))
    listener.close()


def _beat(kind: int, t: float, ids: tuple[str, ...] = ("a",)) -> Beat:
    return Beat(kind, 0, t, len(ids), ids)


def test_gap_rule_deadline_is_the_last_token_plus_the_target() -> None:
    state = DecodeState(0.1, GAP)
    state.on_beat(_beat(START, 1.0))
    assert state.next_deadline_s == pytest.approx(1.1)  # decode was idle: due from START
    state.on_beat(_beat(END, 1.02))
    assert state.next_deadline_s == pytest.approx(1.12)
    assert state.solo_step_s == pytest.approx(0.02)  # no prefill ran: a solo step
    state.on_beat(_beat(START, 1.05))  # a quiet gap between steps: 0.03 s
    state.prefill_running = 1  # a prefill starts during the step: the step is shared
    state.on_beat(_beat(END, 1.25))
    assert state.shared_step_s == pytest.approx(0.2)
    assert state.solo_step_s == pytest.approx(0.02)
    assert state.solo_between_s == pytest.approx(0.03)
    state.parked_since = 1.3  # parked for decode: the step is solo again
    state.on_beat(_beat(START, 1.3))
    state.on_beat(_beat(END, 1.32))
    assert state.solo_step_s == pytest.approx(0.02)


def test_mean_rule_banks_slack_and_follows_the_tightest_request() -> None:
    state = DecodeState(0.1, MEAN)
    for i in range(5):  # "a" decodes five quick tokens: 0.01 s apart
        state.on_beat(_beat(START, 1.0 + 0.01 * i - 0.005))
        state.on_beat(_beat(END, 1.0 + 0.01 * i))
    # First token at 1.0, 4 gaps so far: the 6th may come by 1.0 + 5 * 0.1.
    assert state.next_deadline_s == pytest.approx(1.5)
    state.on_beat(_beat(START, 1.045, ("a", "b")))
    state.on_beat(_beat(END, 1.05, ("a", "b")))  # "b" joins: its next is due at 1.15
    assert state.next_deadline_s == pytest.approx(1.15)
    state.on_beat(_beat(START, 1.055, ("a",)))
    state.on_beat(_beat(END, 1.06, ("a",)))  # "b" left: back to "a" (1.0 + 7 * 0.1)
    assert state.next_deadline_s == pytest.approx(1.7)


def test_decode_state_checks_its_settings() -> None:
    with pytest.raises(ValueError, match="tbt_target_s"):
        DecodeState(0.0)
    with pytest.raises(ValueError, match="rule"):
        DecodeState(0.1, "p99")


def test_wait_end_is_bounded() -> None:
    state = DecodeState(0.1)
    t0 = time.monotonic()
    assert not state.wait_end(0, 0.05)
    assert 0.04 < time.monotonic() - t0 < 1.0


NIXL = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_consumer",
    "kv_buffer_device": "cpu",
    "kv_load_failure_policy": "recompute",
}


def test_with_beats_wraps_a_connector_in_multiconnector() -> None:
    config = with_beats(NIXL, "/run/b.sock")
    assert config["kv_connector"] == "MultiConnector"
    assert {k: config[k] for k in NIXL if k != "kv_connector"} == {
        k: v for k, v in NIXL.items() if k != "kv_connector"
    }
    first, beats = config["kv_connector_extra_config"]["connectors"]
    assert first == NIXL  # first: it alone answers how many tokens are loaded
    assert beats == beat_connector_config("/run/b.sock")
    # Another beat target joins the same MultiConnector.
    again = with_beats(config, ["/run/c.sock", "/run/d.sock"])
    connectors = again["kv_connector_extra_config"]["connectors"]
    assert len(connectors) == 3
    assert connectors[2]["kv_connector_extra_config"][SOCKET_KEY] == ["/run/c.sock", "/run/d.sock"]
    assert with_beats(None, "/run/b.sock") == beat_connector_config("/run/b.sock")


def test_with_beats_is_a_valid_vllm_config() -> None:
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    config = KVTransferConfig(**with_beats(NIXL, "/run/b.sock"))
    assert config.kv_connector == "MultiConnector" and config.is_kv_consumer
    for child in config.kv_connector_extra_config["connectors"]:
        cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**child))
        # vLLM 0.32 registers "NixlConnector" as its pull connector.
        assert cls.__name__ in ("NixlPullConnector", "NixlConnector", "FlowPrefillBeatConnector")
