"""Where tensor-parallel ranks park: one target checkpoint agreed without a collective.

Every rank runs the same forward pass on its shard and meets the others in collectives
(the all-reduces after ``o_proj``, ``down_proj`` / ``experts``). If ranks parked where each
happened to see the preempt signal, a rank that saw it later would run on into a collective
that a parked rank never joins: a deadlock. So all ranks must park at the *same* checkpoint
number (the paper's synchronised counter).

The obvious protocol, an all-reduce of the leader's flag at every checkpoint (an earlier
version of this engine), costs one collective at each of the ~5 checkpoints per
layer even though a preemption is rare. Here the ranks of one instance (processes on one
machine) share a small table in shared memory instead, guarded by one cross-process lock:

* At every checkpoint ``k`` of task slot ``s``, a rank takes the lock, records ``count[s][r]
  = k`` and reads ``target[s]``. Nothing else: no communication, ~1-2 µs.
* The leader (rank 0, the scheduler's side), signalled and with no target pending, sets
  ``target[s] = max(k, max over followers of count[s][f] + 1)`` in the same critical
  section. A follower whose count is below ``k`` has not yet checked checkpoint ``k``: it
  will, under the lock, after this write, and park there. A follower already at ``c >= k``
  passed ``c`` without seeing a target, so the target must lie beyond ``c``. Either way
  every rank checks the target checkpoint after the write: all park at exactly ``target``.
  No rank can be far ahead: it would block in the next collective the leader has not
  reached, so the target is at most one collective-gap past ``k`` (usually ``k`` itself).
* At ``target``, a follower drains its device work, marks itself parked and waits for the
  leader's command. The leader waits until every follower is parked there, then parks
  through the scheduler's :class:`~flowprefill.prefill.executor.preemption.TaskControl` (device
  sync, ACK, wait) — so the ACK means the whole instance has stopped. When the scheduler
  resumes (or cancels) the task, the leader clears the target and sends RESUME (or CANCEL)
  to every follower (:mod:`flowprefill.prefill.tp.ranks`).

Failure modes: a rank that dies while holding the lock (or never arrives at the target)
would block the others; every wait here is bounded (:data:`LOCK_TIMEOUT_S`,
:data:`ARRIVAL_TIMEOUT_S`) and raises :class:`RankFailedError`, and the instance's monitor
takes the instance down when a rank process exits (:mod:`flowprefill.prefill.tp.ranks`). Ranks on
different machines cannot share the table: tensor parallelism here is within one machine.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from typing import Any

from flowprefill.contracts.names import RankCommand
from flowprefill.errors import RankFailedError
from flowprefill.prefill.executor.preemption import TaskControl

SLOTS = 64
"""Task slots: tasks alive at once on an instance (one running plus the parked ones)."""

LOCK_TIMEOUT_S = 30.0
"""A critical section is a few µs; a lock held this long belongs to a dead rank."""

ARRIVAL_TIMEOUT_S = 300.0
"""How long the leader waits for followers to reach the target (one operator each)."""

NO_TARGET = 0


class SharedTable:
    """Counts and targets per task slot, in shared memory, with one lock.

    Built by the leader before it spawns followers (a spawn-context lock and raw arrays
    travel to child processes as :class:`multiprocessing.Process` arguments).
    """

    def __init__(self, world: int, slots: int = SLOTS, ctx: Any = None) -> None:
        ctx = ctx or multiprocessing.get_context("spawn")
        self.world = world
        self.slots = slots
        self.lock = ctx.Lock()
        self.targets = ctx.RawArray("q", slots)
        self.counts = ctx.RawArray("q", slots * world)
        self.parked = ctx.RawArray("q", slots * world)

    def _acquire(self) -> None:
        if not self.lock.acquire(timeout=LOCK_TIMEOUT_S):
            raise RankFailedError(
                f"tensor-parallel agreement lock not free for {LOCK_TIMEOUT_S:.0f}s: "
                "a rank died inside its critical section"
            )

    def reset(self, slot: int) -> None:
        """Leader, before a task is sent to followers: a fresh slot."""
        self._acquire()
        try:
            self.targets[slot] = NO_TARGET
            base = slot * self.world
            for r in range(self.world):
                self.counts[base + r] = 0
                self.parked[base + r] = 0
        finally:
            self.lock.release()

    def arrive(self, slot: int, rank: int, checkpoint: int, propose: bool) -> int:
        """Rank ``rank`` reached ``checkpoint``; returns the target (0: none). With
        ``propose`` (leader, signalled) and no target pending, sets one first."""
        base = slot * self.world
        self._acquire()
        try:
            self.counts[base + rank] = checkpoint
            target = int(self.targets[slot])
            if target == NO_TARGET and propose:
                ahead = max(int(self.counts[base + f]) for f in range(self.world) if f != rank)
                target = max(checkpoint, ahead + 1)
                self.targets[slot] = target
            return target
        finally:
            self.lock.release()

    def mark_parked(self, slot: int, rank: int, checkpoint: int) -> None:
        self.parked[slot * self.world + rank] = checkpoint  # one aligned word: no lock

    def all_parked(self, slot: int, checkpoint: int) -> bool:
        base = slot * self.world
        return all(self.parked[base + f] == checkpoint for f in range(1, self.world))

    def clear_target(self, slot: int) -> None:
        self._acquire()
        try:
            self.targets[slot] = NO_TARGET
        finally:
            self.lock.release()


class LeaderGate:
    """Rank 0's gate for one task: proposes targets, parks for the scheduler, releases
    followers. ``send(command)`` delivers RESUME / CANCEL to every follower."""

    def __init__(
        self,
        table: SharedTable,
        slot: int,
        send: Callable[[RankCommand], None],
        alive: Callable[[], None] = lambda: None,
    ) -> None:
        self.table, self.slot, self.send, self.alive = table, slot, send, alive
        self.parked_at: list[int] = []

    def at_checkpoint(self, control: TaskControl) -> None:
        k = control.num_checkpoints
        signalled = control.preempt_requested or control.cancelled
        target = self.table.arrive(self.slot, 0, k, propose=signalled)
        if target != k:
            return
        self._wait_followers(k)
        self.parked_at.append(k)
        command = RankCommand.RESUME
        try:
            if control.preempt_requested or control.cancelled:
                control.park()  # raises TaskCancelledError on cancel
        except BaseException:
            command = RankCommand.CANCEL
            raise
        finally:
            # Cleared before the followers move on: a later signal gets a new target.
            self.table.clear_target(self.slot)
            self.send(command)

    def _wait_followers(self, k: int) -> None:
        deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
        pause = 2e-5
        while not self.table.all_parked(self.slot, k):
            self.alive()  # raises RankFailedError once a rank process has exited
            if time.monotonic() > deadline:
                raise RankFailedError(
                    f"tensor-parallel followers did not reach checkpoint {k} within "
                    f"{ARRIVAL_TIMEOUT_S:.0f}s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


class FollowerGate:
    """A follower's gate for one task: parks at the target, waits for the leader."""

    def __init__(self, table: SharedTable, slot: int, rank: int) -> None:
        self.table, self.slot, self.rank = table, slot, rank
        self.parked_at: list[int] = []

    def at_checkpoint(self, control: TaskControl) -> None:
        k = control.num_checkpoints
        if self.table.arrive(self.slot, self.rank, k, propose=False) != k:
            return
        self.parked_at.append(k)
        if control.device_sync is not None:
            control.device_sync()
        self.table.mark_parked(self.slot, self.rank, k)
        # The follower's own control is never signalled: park() waits for the command
        # loop's resume() / cancel() (TaskCancelledError).
        control.park()
