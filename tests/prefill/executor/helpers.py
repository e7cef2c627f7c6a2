"""Test helpers: tasks on their own threads, and preemption at an exact checkpoint."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

import torch

from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor, PrefillOutput

TIMEOUT_S = 30.0


class StopAt(TaskControl):
    """A TaskControl that holds the task at chosen checkpoint numbers (1-based) until the
    test has raised the preemption signal, so the preemption lands exactly there.

    Without this, whether a signal from the test thread arrives before the (fast) tiny
    model finishes would be a race.
    """

    def __init__(self, name: str, at: Iterable[int] = ()) -> None:
        super().__init__(name=name)
        self.at = set(at)
        self.reached = {index: threading.Event() for index in self.at}

    def check(self) -> None:
        upcoming = self.num_checkpoints + 1
        if upcoming in self.at:
            self.reached[upcoming].set()
            deadline = time.monotonic() + TIMEOUT_S
            while not self.preempt_requested:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: nobody preempted at checkpoint {upcoming}")
                time.sleep(0.0002)
        super().check()

    def preempt_at(self, index: int) -> None:
        """From the test thread: wait until the task is at ``index`` and preempt it there."""
        assert self.reached[index].wait(TIMEOUT_S), f"{self.name} never reached {index}"
        parked, _ = self.request_preempt(timeout_s=TIMEOUT_S)
        assert parked and self.parked
        assert self.num_checkpoints == index


class TaskThread:
    """Runs ``executor.run(prompts, control)`` on its own thread, like the pool does."""

    def __init__(
        self, executor: PreemptibleExecutor, prompts: Sequence[Sequence[int]], control: TaskControl
    ) -> None:
        self.control = control
        self.result: list[PrefillOutput] | None = None
        self.error: BaseException | None = None
        self._executor = executor
        self._prompts = prompts
        self._thread = threading.Thread(target=self._main, name=control.name, daemon=True)

    def _main(self) -> None:
        try:
            self.result = self._executor.run(self._prompts, self.control)
        except BaseException as err:  # reported to the test by join()
            self.error = err
        finally:
            self.control.mark_done()

    def start(self) -> TaskThread:
        self._thread.start()
        return self

    def join(self) -> list[PrefillOutput]:
        self._thread.join(TIMEOUT_S)
        assert not self._thread.is_alive(), f"{self.control.name} did not finish"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def random_prompts(lengths: Sequence[int], vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def assert_bit_identical(got: Sequence[PrefillOutput], want: Sequence[PrefillOutput]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.first_token_id == w.first_token_id
        assert g.logits.dtype == torch.float32
        assert torch.equal(g.logits, w.logits)
        assert len(g.kv_cache) == len(w.kv_cache)
        for (gk, gv), (wk, wv) in zip(g.kv_cache, w.kv_cache, strict=True):
            assert torch.equal(gk, wk)
            assert torch.equal(gv, wv)


def assert_close(got: PrefillOutput, want: PrefillOutput, atol: float = 1e-5) -> None:
    """Equal within float tolerance; the first token may differ only on a near-tie."""
    torch.testing.assert_close(got.logits, want.logits, atol=atol, rtol=1e-4)
    if got.first_token_id != want.first_token_id:
        top2 = torch.topk(want.logits, 2).values
        assert float(top2[0] - top2[1]) < atol, "first token differs without a near-tie"
    assert len(got.kv_cache) == len(want.kv_cache)
    for (gk, gv), (wk, wv) in zip(got.kv_cache, want.kv_cache, strict=True):
        assert gk.shape == wk.shape
        torch.testing.assert_close(gk, wk, atol=atol, rtol=1e-4)
        torch.testing.assert_close(gv, wv, atol=atol, rtol=1e-4)
