"""Requests, deadlines and tasks: the one place request state changes.

A :class:`Request` is one prompt waiting for its first token. A :class:`Task` is what the
execution pool runs: a batch of requests formed by the scheduler (one request when it is
not batched). Both carry a small state machine; every transition goes through
``Request.transition`` so an illegal move (resuming a finished request, running a request
twice) fails loudly instead of corrupting the queues. SLO classes are a contract
(:mod:`flowprefill.contracts.slo`); a request carries its class's name and TTFT SLO.

Times are seconds on one clock chosen by the caller (``time.monotonic()`` in the engine,
simulated time in the simulator). Deadlines must be positive on that clock, which both
satisfy, because the S-EDF priority divides by the deadline.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from flowprefill.contracts import slo as slo_contract
from flowprefill.errors import InvalidRequestError


class RequestState(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


_TERMINAL = frozenset({RequestState.FINISHED, RequestState.CANCELLED, RequestState.FAILED})
_ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    RequestState.WAITING: frozenset({RequestState.RUNNING}) | _TERMINAL - {RequestState.FINISHED},
    RequestState.RUNNING: frozenset({RequestState.PREEMPTED}) | _TERMINAL,
    # PREEMPTED -> FINISHED: a preempt can race with the task's last operator; the pool
    # then reports "finished, not parked" and the completion event arrives for a task the
    # scheduler had already moved to Q_p.
    RequestState.PREEMPTED: frozenset({RequestState.RUNNING}) | _TERMINAL,
}


class IllegalTransitionError(RuntimeError):
    """A request was asked to move between states the lifecycle does not allow."""


_request_counter = itertools.count()


@dataclass(eq=False, slots=True)
class Request:
    """One prompt; ``deadline_s = arrival_s + ttft_slo_s``.

    ``prompt_token_ids`` is None in the simulator, which only needs ``num_tokens``.
    """

    request_id: str
    num_tokens: int
    arrival_s: float
    ttft_slo_s: float
    slo_class: str = "default"
    prompt_token_ids: Sequence[int] | None = None
    state: RequestState = RequestState.WAITING
    first_run_s: float | None = None
    finish_s: float | None = None
    num_preemptions: int = 0
    # Tie-breaker for equal priorities: arrival order in this process.
    seq: int = field(default_factory=lambda: next(_request_counter))

    @classmethod
    def create(
        cls,
        request_id: str,
        *,
        arrival_s: float,
        ttft_slo_s: float,
        prompt_token_ids: Sequence[int] | None = None,
        num_tokens: int | None = None,
        slo_class: str = "default",
        max_tokens: int | None = None,
    ) -> Request:
        """Validate and build a request; raises InvalidRequestError naming what is wrong."""
        if prompt_token_ids is not None:
            if num_tokens is not None and num_tokens != len(prompt_token_ids):
                raise InvalidRequestError(
                    f"request {request_id}: num_tokens={num_tokens} does not match the "
                    f"prompt's {len(prompt_token_ids)} tokens"
                )
            num_tokens = len(prompt_token_ids)
        if num_tokens is None or num_tokens <= 0:
            raise InvalidRequestError(f"request {request_id}: the prompt is empty")
        if max_tokens is not None and num_tokens > max_tokens:
            raise InvalidRequestError(
                f"request {request_id}: prompt has {num_tokens} tokens, more than the "
                f"model's context of {max_tokens}"
            )
        if not (
            isinstance(ttft_slo_s, int | float) and ttft_slo_s > 0 and math.isfinite(ttft_slo_s)
        ):
            raise InvalidRequestError(
                f"request {request_id}: TTFT SLO must be a positive number of seconds, "
                f"got {ttft_slo_s!r}"
            )
        if not math.isfinite(arrival_s):
            raise InvalidRequestError(f"request {request_id}: arrival time {arrival_s!r}")
        return cls(
            request_id=request_id,
            num_tokens=num_tokens,
            arrival_s=arrival_s,
            ttft_slo_s=float(ttft_slo_s),
            slo_class=slo_class,
            prompt_token_ids=prompt_token_ids,
        )

    @property
    def deadline_s(self) -> float:
        return slo_contract.deadline_s(self.arrival_s, self.ttft_slo_s)

    @property
    def is_terminal(self) -> bool:
        return self.state in _TERMINAL

    @property
    def ttft_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def met_slo(self) -> bool | None:
        ttft = self.ttft_s
        return None if ttft is None else slo_contract.met_slo(ttft, self.ttft_slo_s)

    def transition(self, new: RequestState, now_s: float) -> None:
        """Move to ``new``; the only place a request's state changes."""
        if new not in _ALLOWED.get(self.state, frozenset()):
            raise IllegalTransitionError(
                f"request {self.request_id}: cannot go from {self.state} to {new}"
            )
        if new is RequestState.RUNNING and self.first_run_s is None:
            self.first_run_s = now_s
        elif new is RequestState.PREEMPTED:
            self.num_preemptions += 1
        if new in _TERMINAL:
            self.finish_s = now_s
        self.state = new

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.num_tokens} tok, {self.slo_class}, "
            f"deadline={self.deadline_s:.3f}, {self.state})"
        )


_task_counter = itertools.count()


@dataclass(eq=False, slots=True)
class Task:
    """A batch of requests executed together; ``leader`` is the one the batch was built for.

    ``progress`` (0..1) is written by the executor at checkpoints and read by the scheduler
    to predict the remaining time of a preempted or running task.
    """

    requests: list[Request]
    task_id: int = field(default_factory=lambda: next(_task_counter))
    progress: float = 0.0

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("a task needs at least one request")

    @property
    def leader(self) -> Request:
        return self.requests[0]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    def transition(self, new: RequestState, now_s: float) -> None:
        for r in self.requests:
            if not r.is_terminal:
                r.transition(new, now_s)

    def __repr__(self) -> str:
        ids = ",".join(r.request_id for r in self.requests)
        return f"Task#{self.task_id}[{ids}]"
