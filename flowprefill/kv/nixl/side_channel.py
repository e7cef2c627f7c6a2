"""The producer's side channel: where a consumer fetches our NIXL agent metadata.

vLLM's consumer connects a ZMQ ``REQ`` socket to ``tcp://remote_host:remote_port`` (from
the request's ``kv_transfer_params``) and sends ``msgpack((b"get_meta_msg", pp_rank,
tp_rank))``; we answer two frames, the rank's encoded ``NixlHandshakePayload`` and
``msgpack(time.perf_counter())`` (the consumer estimates our clock's offset from it). The
consumer gives up after 5 s, so the loop never blocks on anything but its socket.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

import msgspec
import zmq

from flowprefill.contracts.nixl import GET_META_MSG

log = logging.getLogger(__name__)

POLL_MS = 200


class SideChannel:
    """A ZMQ ROUTER bound to ``host:port`` answering handshakes from ``payloads``
    (``(pp_rank, tp_rank)`` → encoded payload), on its own daemon thread."""

    def __init__(self, host: str, port: int, payloads: Mapping[tuple[int, int], bytes]) -> None:
        self.payloads = dict(payloads)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        bind_host = "*" if host in ("", "0.0.0.0", "::") else host
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
            else:
                self._sock.bind(f"tcp://{bind_host}:{port}")
                self.port = port
        except zmq.ZMQError as e:
            self._sock.close()
            raise OSError(f"NIXL side channel cannot listen on {host}:{port}: {e}") from e
        self.handshakes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nixl-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(POLL_MS)):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            reply = self._answer(frames)
            if reply is not None:
                try:
                    self._sock.send_multipart(reply)
                except zmq.ZMQError as e:  # the peer went away; keep serving others
                    log.warning("NIXL side channel: reply failed: %s", e)
        self._sock.close()

    def _answer(self, frames: list[bytes]) -> list[bytes] | None:
        if len(frames) != 3:
            log.warning("NIXL side channel: ignoring a %d-frame message", len(frames))
            return None
        identity, _, body = frames
        try:
            message, pp_rank, tp_rank = msgspec.msgpack.decode(body)
            payload = self.payloads.get((pp_rank, tp_rank))
        except (msgspec.DecodeError, ValueError, TypeError):  # TypeError: unhashable ranks
            log.warning("NIXL side channel: ignoring an undecodable message")
            return None
        if message != GET_META_MSG or payload is None:
            # A REQ socket waits for an answer; none makes the consumer time out with
            # a clear "no metadata" error rather than decode something wrong.
            log.warning(
                "NIXL side channel: no metadata for %r pp=%r tp=%r", message, pp_rank, tp_rank
            )
            return None
        self.handshakes += 1
        return [identity, b"", payload, msgspec.msgpack.encode(time.perf_counter())]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * POLL_MS / 1000 + 1)
