"""``--decode-nice`` under the kernel's autogroup scheduling: the supervisor sets the nice of
a niced child's session (``/proc/<pid>/autogroup``), where the kernel groups by session,
and falls back to the process's own nice where it cannot."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from flowprefill.cli import main
from flowprefill.contracts.names import Role
from flowprefill.contracts.processes import ProcessSpec
from flowprefill.stack.supervisor import AUTOGROUP_NICE_ENV, Child, set_autogroup_nice

AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")


def _autogroup_on() -> bool:
    try:
        return AUTOGROUP.read_text().strip() == "1"
    except OSError:
        return False


needs_autogroup = pytest.mark.skipif(
    not _autogroup_on(), reason="this kernel does not schedule by autogroup"
)


def _autogroup(pid: int) -> tuple[str, int]:
    """(name, nice) of ``pid``'s autogroup, from ``/autogroup-268 nice 7``."""
    m = re.fullmatch(
        r"(/autogroup-\d+) nice (-?\d+)", Path(f"/proc/{pid}/autogroup").read_text().strip()
    )
    assert m, f"unexpected /proc/{pid}/autogroup"
    return m[1], int(m[2])


def _child(
    tmp_path: Path, script: str, name: str, nice: int, env: dict[str, str] | None = None
) -> Child:
    spec = ProcessSpec(Role.DECODE, (sys.executable,), ("-c", script), 0, "/")
    return Child(name, spec, tmp_path / f"{name}.log", env or {}, nice=nice)


# Prints its autogroup, then that of a process it starts: both must be the session's.
_REPORT = (
    "import subprocess, sys, time\n"
    "print(open('/proc/self/autogroup').read().strip(), flush=True)\n"
    "grandchild = \"print(open('/proc/self/autogroup').read().strip())\"\n"
    "subprocess.run([sys.executable, '-c', grandchild])\n"
    "time.sleep(30)\n"
)


@needs_autogroup
def test_a_niced_childs_session_gets_its_nice_and_what_it_starts_shares_it(tmp_path: Path) -> None:
    child = _child(tmp_path, _REPORT, "decode-0", nice=7)
    child.start()
    try:
        assert child.proc is not None
        assert child.nice_scope == "autogroup"
        name, nice = _autogroup(child.proc.pid)
        assert nice == 7
        # Its own session, not the supervisor's (whose file is empty where the supervisor runs
        # in the root task group, as under a CI runner started outside any session's group).
        assert name not in Path(f"/proc/{os.getpid()}/autogroup").read_text()
        deadline = time.monotonic() + 30
        while len(child.log_path.read_text().splitlines()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.log_path.read_text().splitlines() == [f"{name} nice 7"] * 2
        assert os.getpriority(os.PRIO_PROCESS, child.proc.pid) >= 7  # and the process's own
    finally:
        child.stop(5)


@needs_autogroup
def test_switched_off_or_not_niced_the_session_keeps_nice_0(tmp_path: Path) -> None:
    off = _child(tmp_path, "import time; time.sleep(30)", "decode-0", 7, {AUTOGROUP_NICE_ENV: "0"})
    plain = _child(tmp_path, "import time; time.sleep(30)", "prefill-0", 0)
    for c in (off, plain):
        c.start()
    try:
        assert off.proc is not None and plain.proc is not None
        assert (off.nice_scope, _autogroup(off.proc.pid)[1]) == ("process", 0)
        assert os.getpriority(os.PRIO_PROCESS, off.proc.pid) >= 7  # the fallback still applies
        assert (plain.nice_scope, _autogroup(plain.proc.pid)[1]) == ("", 0)
    finally:
        for c in (off, plain):
            c.stop(5)


def test_where_the_kernel_does_not_group_by_session_nothing_is_written(tmp_path: Path) -> None:
    # A directory laid out as /proc: the function reads and writes files, nothing else.
    proc = tmp_path / "proc"
    (proc / "sys" / "kernel").mkdir(parents=True)
    (proc / "42").mkdir()
    target = proc / "42" / "autogroup"
    target.write_text("/autogroup-1 nice 0\n")
    assert set_autogroup_nice(42, 10, {}, proc) == f"no {proc}/sys/kernel/sched_autogroup_enabled"
    (proc / "sys" / "kernel" / "sched_autogroup_enabled").write_text("0\n")
    assert "autogroup scheduling is off" in str(set_autogroup_nice(42, 10, {}, proc))
    (proc / "sys" / "kernel" / "sched_autogroup_enabled").write_text("1\n")
    assert set_autogroup_nice(42, 10, {AUTOGROUP_NICE_ENV: "0"}, proc) == f"{AUTOGROUP_NICE_ENV}=0"
    assert target.read_text() == "/autogroup-1 nice 0\n"
    assert set_autogroup_nice(42, 10, {}, proc) is None
    assert target.read_text() == "10\n"
    why = set_autogroup_nice(43, 10, {}, proc, retry_s=0)  # no such process
    assert why is not None and why.startswith(f"{proc}/43/autogroup: ")


def test_bad_switch_values_and_nice_values_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"{AUTOGROUP_NICE_ENV} must be 0 or 1, got 'yes'"):
        set_autogroup_nice(os.getpid(), 10, {AUTOGROUP_NICE_ENV: "yes"}, tmp_path)
    with pytest.raises(ValueError, match=r"within -20\.\.19, got 20"):
        set_autogroup_nice(os.getpid(), 20, {}, tmp_path)


def test_up_refuses_a_decode_nice_or_switch_it_cannot_apply(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["up", "--decode-nice", "25", "--run-dir", str(tmp_path)]) == 2
    assert "--decode-nice must be within 0..19, got 25" in capsys.readouterr().err
    monkeypatch.setenv(AUTOGROUP_NICE_ENV, "off")
    assert main(["up", "--run-dir", str(tmp_path)]) == 2
    assert f"{AUTOGROUP_NICE_ENV} must be 0 or 1, got 'off'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


# Spins on one core for ``wall`` seconds, then prints the CPU seconds it got.
_SPIN = (
    "import os, time\n"
    "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
    "end = time.monotonic() + 2.0\n"
    "while time.monotonic() < end:\n"
    "    pass\n"
    "print(time.process_time())\n"
)


def _cpu_shares(tmp_path: Path, env: dict[str, str]) -> tuple[float, float]:
    """CPU seconds of a child at nice 10 and one at nice 0, each in its own session, both
    spinning on the same core at the same time."""
    niced = _child(tmp_path, _SPIN, f"niced-{len(env)}", 10, env)
    other = _child(tmp_path, _SPIN, f"other-{len(env)}", 0, env)
    for c in (niced, other):
        c.start()
    for c in (niced, other):
        assert c.proc is not None and c.proc.wait(60) == 0
    return float(niced.log_path.read_text()), float(other.log_path.read_text())


@needs_autogroup
def test_the_niced_session_gets_a_small_share_of_a_contended_core(tmp_path: Path) -> None:
    # Nice 10 weighs 110 against nice 0's 1024: ~10 % of the core. With the per-process
    # nice alone each session gets an equal share: the fallback this test tells apart.
    niced, other = _cpu_shares(tmp_path, {})
    assert niced < 0.5 * other, (niced, other)
    niced_off, other_off = _cpu_shares(tmp_path, {AUTOGROUP_NICE_ENV: "0"})
    assert niced_off > 0.6 * other_off, (niced_off, other_off)
