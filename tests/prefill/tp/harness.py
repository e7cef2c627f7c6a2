"""Driving a tensor-parallel backend the way the execution pool does, from a test."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from flowprefill.prefill.executor.context import activate
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PrefillOutput
from flowprefill.prefill.tp.prefill_backend import TPPrefillBackend

TIMEOUT_S = 60.0
"""Every wait in these tests is bounded: a hang fails the test instead of the suite."""


class Task:
    """One ``backend.run`` on its own thread with its own TaskControl, as the pool runs it."""

    def __init__(
        self, backend: TPPrefillBackend, prompts: Sequence[Sequence[int]], name: str
    ) -> None:
        self.control = TaskControl(name=name)
        self.result: list[PrefillOutput] | None = None
        self.error: BaseException | None = None
        self._backend, self._prompts = backend, prompts
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def _main(self) -> None:
        try:
            with activate(self.control):
                self.result = self._backend.run(self._prompts, self.control)
        except BaseException as e:  # reported by join()
            self.error = e
        finally:
            self.control.mark_done()

    def start(self) -> Task:
        self._thread.start()
        return self

    def wait_checkpoints(self, n: int) -> None:
        """Until the task passed ``n`` checkpoints (or finished)."""
        deadline = time.monotonic() + TIMEOUT_S
        while self.control.num_checkpoints < n and not self.control.done:
            assert time.monotonic() < deadline, f"{self.control.name} stuck"
            time.sleep(0.0002)

    def preempt(self) -> bool:
        parked, _ = self.control.request_preempt(timeout_s=TIMEOUT_S)
        return parked

    def join(self) -> list[PrefillOutput] | None:
        self._thread.join(TIMEOUT_S)
        assert not self._thread.is_alive(), f"{self.control.name} did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def prompts(lengths: Sequence[int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def assert_same(a: Sequence[PrefillOutput], b: Sequence[PrefillOutput]) -> None:
    """Bit-identical first tokens, logits and KV."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.first_token_id == y.first_token_id
        assert torch.equal(x.logits, y.logits)
        for (k1, v1), (k2, v2) in zip(x.kv_cache, y.kv_cache, strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


def ranks_agree(backend: TPPrefillBackend) -> dict[int, list[int]]:
    """Every follower parked each task at the same checkpoints as rank 0; returns them."""
    leader = dict(backend.parked_at)
    for rank, report in enumerate(backend.follower_reports(), start=1):
        for key, parked in leader.items():
            assert report.get(key) == parked, (
                f"task {key}: rank 0 parked at {parked}, rank {rank} at {report.get(key)}"
            )
    return leader
