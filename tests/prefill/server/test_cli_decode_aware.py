"""``serve-prefill``'s decode-aware flags override engine.json, and the engine they build
listens for beats and parks (counted in its metrics)."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from flowprefill.contracts import EngineConfig
from flowprefill.contracts.engine import DecodeAwareSettings
from flowprefill.kv.beats import END, START, BeatSender
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.server.cli import add_arguments, build_engine, resolve_config


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_turn_it_on_and_override_the_file(tmp_path: Path) -> None:
    assert resolve_config(_args()).decode_aware is None
    on = resolve_config(_args("--decode-aware-socket", str(tmp_path / "b.sock")))
    assert on.decode_aware == DecodeAwareSettings(socket_path=str(tmp_path / "b.sock"))
    path = tmp_path / "engine.json"
    path.write_text(
        EngineConfig(
            decode_aware=DecodeAwareSettings(socket_path="/run/b.sock", rule="mean")
        ).model_dump_json()
    )
    over = resolve_config(_args("--config", str(path), "--decode-aware-tbt", "0.2")).decode_aware
    assert over == DecodeAwareSettings(socket_path="/run/b.sock", rule="mean", tbt_target_s=0.2)


def test_bad_flags_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="needs --decode-aware-socket"):
        resolve_config(_args("--decode-aware-tbt", "0.2"))
    with pytest.raises(SystemExit, match="tbt_target_s"):
        resolve_config(_args("--decode-aware-socket", "/run/b.sock", "--decode-aware-tbt", "-1"))


class _Backend:
    """A backend whose one task reaches checkpoints until told to stop (no model needed:
    the park happens in the checkpoint, whatever runs between them)."""

    max_prompt_tokens = 1000

    def validate(self, prompts: Sequence[Sequence[int]]) -> None:
        return None

    def run(self, prompts: Sequence[Sequence[int]], control: TaskControl) -> Sequence[Any]:
        for _ in range(200):
            control.check()
            time.sleep(0.002)
        return [0 for _ in prompts]


class _Predictor:
    def predict_s(self, num_tokens: int) -> float:
        return 0.001 * num_tokens


def _engine_and_decode(tmp_path: Path) -> tuple[PrefillEngine, BeatSender, str]:
    """An engine built by serve-prefill's flags (decode-aware, a 10 ms TBT target), and a
    sender of decode's beats to it; the socket's path."""
    sock = str(tmp_path / "b.sock")
    config = resolve_config(_args("--decode-aware-socket", sock, "--decode-aware-tbt", "0.01"))
    return build_engine(config, _Backend(), _Predictor()), BeatSender(sock), sock


def test_engine_listens_parks_and_counts(tmp_path: Path) -> None:
    engine, sender, sock = _engine_and_decode(tmp_path)
    with engine:
        assert Path(sock).exists()
        # Decode is mid-step and its token is due in 10 ms: the task parks until END.
        sender.send(END, 1, ["a"])
        sender.send(START, 2, ["a"])
        future = engine.submit([1, 2, 3], ttft_slo_s=10.0)
        deadline = time.monotonic() + 10
        state = engine.decode_yield.state if engine.decode_yield else None
        assert state is not None
        while state.parked_since is None:
            assert time.monotonic() < deadline, "never parked"
            time.sleep(0.001)
        sender.send(END, 2, [])  # the step ended, nothing decodes any more
        future.result(timeout=30)
    sender.close()
    assert not Path(sock).exists()  # the listener is gone with the engine
    sample = engine.metrics.registry.get_sample_value
    assert (sample("flowprefill_prefill_decode_parks_total") or 0) >= 1
    assert (sample("flowprefill_prefill_decode_parked_seconds_total") or 0) > 0
    assert sample("flowprefill_prefill_decode_park_timeouts_total") == 0


def test_engine_vetoes_a_park_that_would_cost_a_tight_tasks_deadline(tmp_path: Path) -> None:
    engine, sender, _ = _engine_and_decode(tmp_path)
    with engine:
        decide = engine.decode_yield
        assert decide is not None
        sender.send(END, 1, ["a"])
        sender.send(START, 2, ["a"])  # decode mid-step, its token due in 10 ms, throughout
        # 3 ms predicted against a 2 ms target: late from the start, so it never parks.
        engine.submit([1, 2, 3], ttft_slo_s=0.002).result(timeout=30)
        sender.send(END, 2, [])
    sender.close()
    assert decide.parks == 0 and decide.vetoes > 0
    sample = engine.metrics.registry.get_sample_value
    assert (sample("flowprefill_prefill_decode_parks_total") or 0) == 0
    assert sample("flowprefill_prefill_decode_park_vetoes_total") == decide.vetoes


def test_engine_tells_the_policy_by_when_the_waiting_head_must_start(tmp_path: Path) -> None:
    sock = str(tmp_path / "b.sock")
    config = resolve_config(_args("--decode-aware-socket", sock))
    engine = build_engine(config, _Backend(), _Predictor())
    with engine:
        decide = engine.decode_yield
        assert decide is not None and decide.queue_start_by_s == math.inf
        running = engine.submit([1, 2, 3], ttft_slo_s=2.0)
        deadline = time.monotonic() + 10
        while engine.scheduler.running is None:
            assert time.monotonic() < deadline, "the first task never ran"
            time.sleep(0.001)
        # Less urgent than the running task: it waits, and must start 10 s - 3 ms from now.
        waiting = engine.submit([4, 5, 6], ttft_slo_s=10.0)
        while decide.queue_start_by_s == math.inf:
            assert time.monotonic() < deadline, "never published"
            time.sleep(0.001)
        assert decide.queue_start_by_s - time.monotonic() == pytest.approx(9.997, abs=0.5)
        running.result(timeout=30)
        waiting.result(timeout=30)
    assert decide.queue_start_by_s == math.inf  # nothing waits any more
