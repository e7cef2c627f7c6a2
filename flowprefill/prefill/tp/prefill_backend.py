"""A tensor-parallel instance as the engine sees it: a prefill backend on rank 0.

:class:`TPPrefillBackend` is the :class:`~flowprefill.prefill.engine.PrefillBackend` that
:class:`~flowprefill.prefill.engine.PrefillEngine` runs tasks on when ``tp_size > 1``.
``run`` allocates the task a slot of the agreement table, sends the task to every
follower, installs the leader's gate on the scheduler's
:class:`~flowprefill.prefill.executor.preemption.TaskControl` and runs rank 0's share of
the prefill; its outputs carry every KV head (gathered at the end of the task).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from flowprefill.contracts import EngineConfig
from flowprefill.contracts.names import RankCommand
from flowprefill.errors import FlowPrefillError, RankFailedError
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PrefillOutput, PromptLike
from flowprefill.prefill.tp.agreement import LeaderGate
from flowprefill.prefill.tp.ranks import RankGroup

PARK_HISTORY = 4096


RANK_FAILURE_WAIT_S = 1.0
"""How long a failed collective waits for the group to say which rank died."""


class TPPrefillBackend:
    """Rank 0 of a ``config.tp_size``-rank instance; spawns the others on creation."""

    def __init__(self, config: EngineConfig) -> None:
        self.group = RankGroup(config)
        self.executor = self.group.executor
        self.config = config
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._free_slots = list(range(self.group.table.slots))
        self.parked_at: deque[tuple[int, list[int]]] = deque(maxlen=PARK_HISTORY)
        """(task key, checkpoints where rank 0 parked) of recent tasks."""

    # The executor's facts, for the engine, the profiler and the KV sink.
    @property
    def max_prompt_tokens(self) -> int:
        return self.executor.max_prompt_tokens

    @property
    def vocab_size(self) -> int:
        return self.executor.vocab_size

    @property
    def device(self) -> torch.device:
        return self.executor.device

    @property
    def model_config(self) -> Any:
        return self.executor.model.config

    def validate(self, prompts: Sequence[PromptLike]) -> list[torch.Tensor]:
        return self.executor.validate(prompts)

    def estimate_parked_bytes(self, num_tokens: int, num_requests: int = 1) -> int:
        """Bound on what one rank's parked task holds (the budget is per process): rank
        0's executor bounds it as if it held every KV head, an upper bound for its shard."""
        return self.executor.estimate_parked_bytes(num_tokens, num_requests)

    def run(self, prompts: Sequence[PromptLike], control: TaskControl) -> list[PrefillOutput]:
        """One task across all ranks, on the calling (task) thread."""
        tokens = [t.tolist() for t in self.executor.validate(prompts)]
        key = next(self._ids)
        slot = self._take_slot()
        gate = LeaderGate(
            self.group.table,
            slot,
            send=lambda command: self.group.send(command, key),
            alive=self.group.check_alive,
        )
        try:
            self.group.table.reset(slot)
            self.group.send(RankCommand.SUBMIT, key, slot, tokens)
            control.gate = gate
            try:
                return self.executor.run(tokens, control)
            except FlowPrefillError:
                raise  # ours already say what happened (a rank failure included)
            except RuntimeError as error:
                # A dead rank shows up first as the leader's collective failing; name the
                # rank, as the engine and its clients are told, rather than gloo's error.
                failure = self.group.wait_failure(RANK_FAILURE_WAIT_S)
                if failure is None:
                    raise
                raise failure from error
        finally:
            control.gate = None
            self.parked_at.append((key, list(gate.parked_at)))
            with self._lock:
                self._free_slots.append(slot)

    def _take_slot(self) -> int:
        with self._lock:
            if not self._free_slots:
                raise RankFailedError(
                    f"all {self.group.table.slots} tensor-parallel task slots are in use"
                )
            return self._free_slots.pop()

    def follower_reports(self) -> list[dict[int, list[int]]]:
        return self.group.reports()

    def close(self) -> None:
        self.executor.close()
        self.group.close()

    def __enter__(self) -> TPPrefillBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
