"""Decode beats: vLLM decode tells a prefill engine on the same device when its steps run.

A *beat* is one Unix datagram sent by decode's worker when a step's forward pass starts
(``START``) and when it has ended (``END``), carrying the monotonic time (one clock for
every process of a host: ``CLOCK_MONOTONIC``), a per-worker step number and the ids of
the requests that step decodes. Stock vLLM sends them through a KV connector of ours
loaded by its documented extension point (:mod:`flowprefill.kv.beat_connector`, combined
with the real KV connector by vLLM's ``MultiConnector``; its configuration is a contract,
:mod:`flowprefill.contracts.beats`); the prefill engine listens (:class:`BeatListener`)
and keeps decode's state (:class:`DecodeState`), which its decode-aware yield reads at
every checkpoint (:mod:`flowprefill.prefill.executor.decode_yield`).

Contract: sending never blocks and never fails the sender (a datagram to a socket no one
listens on, or a full queue, is dropped silently: decode must not care whether prefill
listens); a beat the listener cannot parse is counted and ignored. The listener sees at
worst lost beats, never stale ones out of order within one sender (a Unix datagram
socket keeps order and does not duplicate).

Wire format (little endian): ``magic b"FPB1"``, kind ``u8``, step ``u32``, time ``f64``
(seconds, ``time.monotonic()``), number of decoding requests ``u32``, then their ids,
UTF-8, joined by ``\\n`` (cut to fit :data:`MAX_DATAGRAM` — the count stays exact).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from flowprefill.contracts.beats import socket_paths

logger = logging.getLogger(__name__)

MAGIC = b"FPB1"
START, END = 0, 1
_HEADER = struct.Struct("<4sBIdI")
MAX_DATAGRAM = 65536
"""Beats are cut to this size (ids dropped from the end); far under Linux's datagram
limit for Unix sockets, so a send never fails for size."""

GAP, MEAN = "gap", "mean"
RULES = (GAP, MEAN)
"""How a TBT target is judged (:attr:`DecodeState.next_deadline_s`)."""


@dataclass(frozen=True, slots=True)
class Beat:
    """One decoded datagram."""

    kind: int
    step: int
    time_s: float
    num_decoding: int
    req_ids: tuple[str, ...]


def encode(kind: int, step: int, time_s: float, req_ids: list[str] | tuple[str, ...]) -> bytes:
    """A beat's datagram (ids cut to fit :data:`MAX_DATAGRAM`; the count is exact)."""
    if kind not in (START, END):
        raise ValueError(f"beat kind must be START (0) or END (1), got {kind!r}")
    head = _HEADER.pack(MAGIC, kind, step & 0xFFFFFFFF, time_s, len(req_ids))
    body = "\n".join(req_ids).encode()
    room = MAX_DATAGRAM - len(head)
    if len(body) > room:
        body = body[:room]
        body = body[: body.rfind(b"\n") + 1 if b"\n" in body else 0].rstrip(b"\n")
    return head + body


def decode(data: bytes) -> Beat:
    """Parse a datagram; ValueError naming what is wrong with it."""
    if len(data) < _HEADER.size:
        raise ValueError(
            f"beat of {len(data)} bytes is shorter than its {_HEADER.size}-byte header"
        )
    magic, kind, step, time_s, count = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"beat magic {magic!r} is not {MAGIC!r}")
    if kind not in (START, END):
        raise ValueError(f"beat kind {kind} is neither START nor END")
    if not math.isfinite(time_s):
        raise ValueError(f"beat time {time_s!r} is not finite")
    body = data[_HEADER.size :]
    ids = tuple(body.decode(errors="replace").split("\n")) if body else ()
    return Beat(kind, step, time_s, count, ids)


class BeatSender:
    """Decode's side: fire-and-forget datagrams to each of ``paths`` (a few µs each)."""

    def __init__(self, paths: str | list[str] | tuple[str, ...]) -> None:
        self.paths = socket_paths(paths)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self.sent = 0
        self.dropped = 0

    def send(self, kind: int, step: int, req_ids: list[str] | tuple[str, ...] = ()) -> None:
        """Send one beat stamped now; dropped silently where nobody listens or the
        listener's queue is full (both are the listener's business, not decode's)."""
        data = encode(kind, step, time.monotonic(), req_ids)
        for path in self.paths:
            try:
                self._sock.sendto(data, path)
                self.sent += 1
            except OSError:  # ENOENT/ECONNREFUSED: no listener; EAGAIN: queue full
                self.dropped += 1

    def close(self) -> None:
        self._sock.close()


# ------------------------------------------------------------------- listener


@dataclass(slots=True)
class _Member:
    first_end_s: float
    num_gaps: int = 0


class DecodeState:
    """What the prefill engine knows of decode, from beats (updated by the listener
    thread, read by the prefill task's thread at checkpoints).

    Fields read without a lock are single references or floats, each replaced whole; the
    condition only wakes a task waiting for an ``END`` beat.

    * ``active``: some request was decoding at the last beat, and that beat is recent
      (the hot-path flag: False means nothing is due).
    * ``in_step`` / ``step_start_s``: a step's ``START`` came and its ``END`` has not.
    * ``last_end_s``: the last step's ``END``; ``end_count`` counts ``END`` beats.
    * ``next_deadline_s``: when the next token must come. Rule ``gap`` (default): the
      last ``END`` plus ``tbt_target_s`` — every gap within the target, as ``flowprefill
      bench`` judges TBT. Rule ``mean``: so that no decoding request's mean gap so far (its
      TPOT since its first decode step) passes the target — the simulator's
      ``flowprefill-da`` rule, which lets a request bank slack from quick steps.
    * ``solo_step_s`` / ``shared_step_s``: EWMAs of step times with no prefill running
      (or parked for it) and with a prefill running; ``solo_between_s``: of the time from
      one ``END`` to the next ``START`` without prefill.
    """

    EWMA = 0.2

    def __init__(self, tbt_target_s: float, rule: str = GAP) -> None:
        if not tbt_target_s > 0:
            raise ValueError(f"tbt_target_s must be > 0, got {tbt_target_s!r}")
        if rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
        self.tbt_target_s = float(tbt_target_s)
        self.rule = rule
        self.active = False
        self.in_step = False
        self.step_start_s = 0.0
        self.last_end_s = 0.0
        self.last_beat_s = 0.0
        self.end_count = 0
        self.num_decoding = 0
        self.next_deadline_s = math.inf
        self.solo_step_s: float | None = None
        self.shared_step_s: float | None = None
        self.solo_between_s: float | None = None
        self.beats = 0
        self.bad_beats = 0
        # Written by the prefill side (DecodeYield): is a prefill running / since when is
        # it parked for decode; a step is "solo" if no prefill ran at either of its beats.
        self.prefill_running = 0
        self.parked_since: float | None = None
        self._prefill_at_start = False
        self._members: dict[str, _Member] = {}
        self._cond = threading.Condition()

    def _prefill_busy(self) -> bool:
        return self.prefill_running > 0 and self.parked_since is None

    def on_beat(self, beat: Beat) -> None:
        """Fold one beat in (the listener thread; tests call it directly)."""
        self.beats += 1
        t = beat.time_s
        self.last_beat_s = t
        if beat.kind == START:
            self._prefill_at_start = self._prefill_busy()
            self.step_start_s = t
            self.in_step = True
            self.num_decoding = beat.num_decoding
            if beat.num_decoding and self.next_deadline_s == math.inf:
                # Decode was idle: the first decoding step's token is due a target from now.
                self.next_deadline_s = t + self.tbt_target_s
            self.active = beat.num_decoding > 0
            gap = t - self.last_end_s
            # Only quiet gaps of a running decode teach how long decode needs between steps.
            if self.end_count and not self._prefill_at_start and 0 <= gap < 1.0:
                self.solo_between_s = self._ewma(self.solo_between_s, gap)
            return
        if self.in_step:
            took = t - self.step_start_s
            if took >= 0:
                if self._prefill_at_start or self._prefill_busy():
                    self.shared_step_s = self._ewma(self.shared_step_s, took)
                else:
                    self.solo_step_s = self._ewma(self.solo_step_s, took)
        self._fold_members(beat, t)
        with self._cond:
            self.in_step = False
            self.last_end_s = t
            self.end_count += 1
            self.num_decoding = beat.num_decoding
            self.active = beat.num_decoding > 0
            self._cond.notify_all()

    def _fold_members(self, beat: Beat, t: float) -> None:
        target = self.tbt_target_s
        if self.rule == GAP or not beat.num_decoding:
            self._members = {}
            self.next_deadline_s = t + target if beat.num_decoding else math.inf
        elif len(beat.req_ids) == beat.num_decoding:
            members: dict[str, _Member] = {}
            deadline = math.inf
            for rid in beat.req_ids:
                m = self._members.get(rid)
                if m is None:
                    m = _Member(t)
                else:
                    m.num_gaps += 1
                members[rid] = m
                deadline = min(deadline, m.first_end_s + (m.num_gaps + 1) * target)
            self._members = members  # requests not in this step are done (or preempted)
            self.next_deadline_s = deadline
        else:  # ids cut from the beat: judge the single gap
            self._members = {}
            self.next_deadline_s = t + target if beat.num_decoding else math.inf

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.EWMA * (new - old)

    def wait_end(self, after: int, timeout_s: float) -> bool:
        """Block until ``end_count`` passes ``after`` (an ``END`` beat), or ``timeout_s``
        passes; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.end_count > after, timeout=timeout_s)


class BeatListener:
    """Binds a Unix datagram socket at ``path`` and folds every beat into ``state`` on a
    daemon thread. The path is replaced if it exists (a previous engine's socket);
    :meth:`close` stops the thread and removes it."""

    def __init__(self, path: str | os.PathLike[str], state: DecodeState) -> None:
        self.path = str(path)
        self.state = state
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(self.path)
        except OSError as e:
            self._sock.close()
            raise OSError(e.errno, f"cannot listen for decode beats at {self.path}: {e}") from e
        self._sock.settimeout(0.2)  # how often the thread checks for close()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="decode-beats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError as e:
                if self._closed or e.errno == errno.EBADF:
                    return
                raise
            try:
                beat = decode(data)
            except ValueError as e:
                self.state.bad_beats += 1
                logger.debug("ignored a decode beat: %s", e)
                continue
            self.state.on_beat(beat)

    def close(self) -> None:
        self._closed = True
        self._thread.join(timeout=2.0)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
