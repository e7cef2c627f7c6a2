"""Preemption under tensor parallelism: every rank parks at the same checkpoint.

With tensor parallelism each rank runs the same forward pass on its shard and the ranks
meet in collectives (the all-reduce after ``o_proj`` and after ``down_proj``). Parking
ranks independently would deadlock: a rank that has not yet seen the signal runs ahead
into a collective that a parked rank will not join. The paper's remedy is a synchronised
counter: ranks only park when they reach the *same* checkpoint index.

Here every checkpoint is a tiny all-reduce(MAX) of the leader's (group rank 0's) "preempt
requested" flag over the task's process group, so all ranks learn the decision at the same
checkpoint index:

- flag 0: every rank counts the checkpoint and continues;
- flag 1: the leader parks through its scheduler-facing :class:`TaskControl` (device sync,
  ACK, wait for ``resume``); every other rank counts the checkpoint, drains its own device
  work and blocks in a broadcast from the leader, which sends RESUME (or CANCEL) when the
  scheduler resumes (or cancels) the task.

Only the leader talks to the scheduler; the other ranks follow through the task's group.
Each task must use its own process group: a parked task's followers sit inside a
collective on that group while the next task's collectives run on another one.

Cost: one small all-reduce per checkpoint (tens of µs with gloo on CPU; on GPU with NCCL
the flag would ride on a host-side group, or be folded into the layer's own all-reduce).
The process group's timeout must exceed the longest time a task can stay parked.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from flowprefill.errors import TaskCancelledError
from flowprefill.executor.preemption import TaskControl
from flowprefill.executor.threadlocal import ThreadSlot

RESUME = 0
CANCEL = 1


class TPTaskControl:
    """One task on one rank: the rank-synchronised checkpoint.

    ``control`` is the scheduler's TaskControl on the leader; on followers it is a local
    one that is never signalled (it still counts checkpoints and holds ``device_sync``).
    """

    def __init__(self, control: TaskControl, group: Any) -> None:
        self.control = control
        self.group = group
        self.is_leader = dist.get_rank(group) == 0
        self._leader_global_rank = dist.get_global_rank(group, 0)
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._command = torch.zeros(1, dtype=torch.int32)
        self.parked_at: list[int] = []
        """Checkpoint numbers (1-based) at which this rank parked; equal on all ranks."""

    def check(self) -> None:
        control = self.control
        requested = self.is_leader and (control.preempt_requested or control.cancelled)
        self._flag.fill_(1 if requested else 0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group)
        if not int(self._flag.item()):
            # Not control.check(): a signal raised since we read the flag must wait for the
            # next checkpoint, or the leader would park alone.
            control.num_checkpoints += 1
            return
        self.parked_at.append(control.num_checkpoints + 1)
        if self.is_leader:
            self._lead_park()
        else:
            self._follow_park()

    def _lead_park(self) -> None:
        try:
            # Still signalled (only _park clears it), so this parks: sync, ACK, wait. If
            # the scheduler gave up waiting meanwhile, it returns at once: followers are
            # released all the same.
            self.control.check()
        except TaskCancelledError:
            self._send(CANCEL)
            raise
        self._send(RESUME)

    def _follow_park(self) -> None:
        control = self.control
        control.num_checkpoints += 1
        if control.device_sync is not None:
            control.device_sync()
        dist.broadcast(self._command, src=self._leader_global_rank, group=self.group)
        if int(self._command.item()) == CANCEL:
            raise TaskCancelledError(f"{control.name} was cancelled by the leader rank")

    def _send(self, command: int) -> None:
        self._command.fill_(command)
        dist.broadcast(self._command, src=self._leader_global_rank, group=self.group)


_control: ThreadSlot[TPTaskControl | None] = ThreadSlot(None)


def activate_tp(control: TPTaskControl | None) -> AbstractContextManager[None]:
    """Make ``control`` the target of :func:`tp_checkpoint` (and its group the one
    :func:`current_group` returns) on this thread."""
    return _control.bound(control)


def tp_checkpoint() -> None:
    """Hook body for TP models: a rank-synchronised checkpoint (no-op without a task)."""
    control = _control.get()
    if control is not None:
        control.check()


def current_group() -> Any:
    """The process group of the task running on this thread (None: the default group)."""
    control = _control.get()
    return control.group if control is not None else None
