"""The supervisor of ``flowprefill up``: dead children come back, crash loops stop the stack."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from flowprefill.contracts.names import Role
from flowprefill.contracts.processes import ProcessSpec
from flowprefill.stack.supervisor import (
    Child,
    CrashLoopError,
    RestartPolicy,
    Supervisor,
    describe_exit,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _child(tmp_path: Path, script: str, name: str = "prefill-0") -> Child:
    spec = ProcessSpec(Role.PREFILL, (sys.executable,), ("-c", script), 0, "/")
    return Child(name, spec, tmp_path / f"{name}.log")


def _wait_dead(child: Child) -> None:
    assert child.proc is not None
    child.proc.wait(30)


def _supervisor(children: list[Child], clock: Clock, **policy: float) -> Supervisor:
    return Supervisor(children, Console(quiet=True), RestartPolicy(**policy), clock)  # type: ignore[arg-type]


def test_a_child_that_dies_is_restarted_after_its_backoff(tmp_path: Path) -> None:
    clock = Clock()
    child = _child(tmp_path, "print('serving', flush=True); import os; os.kill(os.getpid(), 9)")
    sup = _supervisor([child], clock, base_backoff_s=2.0)
    sup._start(child)
    _wait_dead(child)
    sup.tick()
    assert child.restart_at_s == clock.now + 2.0 and child.restarts == 0
    clock.now += 1.0
    sup.tick()
    assert child.restarts == 0  # back-off not over
    clock.now += 1.0
    sup.tick()
    assert child.restarts == 1 and child.restart_at_s is None
    _wait_dead(child)
    log = child.log_path.read_text()
    assert log.count("serving") == 2 and "restart 1" in log  # one log, appended, with a marker
    clock.now += 0.5
    sup.tick()  # a second quick death doubles the back-off
    assert child.restart_at_s == clock.now + 4.0


def test_a_child_that_ran_long_enough_starts_from_the_base_backoff_again(tmp_path: Path) -> None:
    clock = Clock()
    child = _child(tmp_path, "import sys; sys.exit(3)")
    sup = _supervisor([child], clock, base_backoff_s=1.0, stable_after_s=60.0)
    child.quick_deaths = 3  # earlier deaths in a row
    sup._start(child)
    _wait_dead(child)
    clock.now += 61.0
    sup.tick()
    assert child.quick_deaths == 1 and child.restart_at_s == clock.now + 1.0


def test_a_crash_loop_stops_the_stack_with_the_log_tail(tmp_path: Path) -> None:
    clock = Clock()
    child = _child(tmp_path, "import sys; print('bad config: no model', flush=True); sys.exit(2)")
    sup = _supervisor([child], clock, base_backoff_s=1.0, max_quick_deaths=3)
    sup._start(child)
    with pytest.raises(CrashLoopError, match=r"(?s)died 3 times in a row.*exit 2.*bad config"):
        for _ in range(10):
            _wait_dead(child)
            sup.tick()
            clock.now += 10.0
            sup.tick()
    assert child.restarts == 2


def test_stop_all_stops_a_stopped_child_too(tmp_path: Path) -> None:
    clock = Clock()
    child = _child(tmp_path, "import time; time.sleep(60)")
    sup = _supervisor([child], clock)
    sup._start(child)
    assert child.proc is not None
    child.proc.send_signal(signal.SIGSTOP)
    time.sleep(0.1)
    started = time.monotonic()
    sup.stop_all()
    assert child.proc.returncode == -signal.SIGTERM
    assert time.monotonic() - started < 10  # not the kill after the 20 s grace


def test_exits_are_described_by_code_or_signal() -> None:
    assert describe_exit(3) == "exit 3"
    assert describe_exit(-9) == "killed by SIGKILL"


def test_what_a_dead_child_started_dies_with_it(tmp_path: Path) -> None:
    """vLLM's API server killed alone leaves its engine core running: the supervisor kills
    the rest of the child's process group, as a pod's death would."""
    import psutil

    pid_file = tmp_path / "grandchild"
    script = (
        "import os, subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); os.kill(os.getpid(), 9)"
    )
    child = _child(tmp_path, script)
    sup = _supervisor([child], Clock())
    sup._start(child)
    _wait_dead(child)
    grandchild = psutil.Process(int(pid_file.read_text()))
    assert grandchild.is_running() and grandchild.status() != psutil.STATUS_ZOMBIE
    sup.tick()
    grandchild.wait(10)  # raises TimeoutExpired if it outlived its parent
    assert child.restart_at_s is not None
