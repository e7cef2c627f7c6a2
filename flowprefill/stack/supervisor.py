"""The processes of ``flowprefill up``: start them, wait for readiness, restart the ones
that die, stop them in order.

A child that dies while the stack is up (what it started in its process group killed
with it, as with a pod) is restarted after a back-off (1 s, doubling per
consecutive quick death, at most 30 s), as a Kubernetes Deployment would restart its pod:
the gateway routes around it meanwhile (a refused connection is retried on another
instance) and sends traffic to it again once it answers. A child that keeps dying soon
after each start (``max_quick_deaths`` times in a row, each within ``stable_after_s`` of
its start) is a crash loop, not a fault to ride out: the supervisor then stops the stack
and shows the tail of the child's log.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console

from flowprefill.contracts.processes import ProcessSpec
from flowprefill.stack.decode import LOOPBACK

log = logging.getLogger(__name__)

AUTOGROUP_NICE_ENV = "FLOWPREFILL_AUTOGROUP_NICE"
"""``0`` turns off :func:`set_autogroup_nice` (only the per-process nice applies, as
before); ``1`` or unset leaves it on."""
_AUTOGROUP_ENABLED = Path("/proc/sys/kernel/sched_autogroup_enabled")


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead child is started again, and when the supervisor gives up on it."""

    base_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0
    """A child that ran this long before dying is restarted after the base back-off again
    (its earlier deaths are forgotten)."""
    max_quick_deaths: int = 5
    """Consecutive deaths, each within ``stable_after_s`` of the start, that make a crash
    loop; 0 never gives up."""

    def backoff_s(self, quick_deaths: int) -> float:
        return min(self.max_backoff_s, self.base_backoff_s * 2 ** max(0, quick_deaths - 1))


def _niceness(nice: int) -> Callable[[], None] | None:
    if nice <= 0:
        return None

    def lower_priority() -> None:  # in the child, before exec: inherited by its children
        os.nice(nice)

    return lower_priority


def set_autogroup_nice(
    pid: int,
    nice: int,
    env: dict[str, str] | None = None,
    proc: Path = Path("/proc"),
    retry_s: float = 1.0,
) -> str | None:
    """Give the autogroup (session) of process ``pid`` the niceness ``nice``; None when set,
    else why not, in words (the caller falls back to the process's own nice).

    Why: where the kernel schedules by autogroup (``kernel.sched_autogroup_enabled = 1``,
    ``man 7 sched``), CFS first shares the CPU fairly between sessions, and a process's
    nice weighs only against processes of its own session. A child started with
    ``start_new_session=True`` is alone in its session, so its ``os.nice`` alone leaves it
    an equal share beside the other children; the session's own nice
    (``/proc/<pid>/autogroup``) is what lowers it. Everything the child starts later stays
    in that session. Raising a nice needs no privilege. Without ``CAP_SYS_ADMIN`` the kernel
    accepts one such write per 100 ms machine-wide (EAGAIN otherwise): retried for
    ``retry_s``.

    Off (a reason returned, nothing written) where ``FLOWPREFILL_AUTOGROUP_NICE=0`` in
    ``env`` (default ``os.environ``), where ``proc`` has no
    ``sys/kernel/sched_autogroup_enabled`` or it is not 1, or where the write is refused
    (no such process, permission). Raises ValueError for a ``FLOWPREFILL_AUTOGROUP_NICE``
    other than 0 or 1, and for ``nice`` outside -20..19."""
    if not -20 <= nice <= 19:
        raise ValueError(f"autogroup nice must be within -20..19, got {nice}")
    switch = (os.environ if env is None else env).get(AUTOGROUP_NICE_ENV, "1")
    if switch not in ("0", "1"):
        raise ValueError(f"{AUTOGROUP_NICE_ENV} must be 0 or 1, got {switch!r}")
    if switch == "0":
        return f"{AUTOGROUP_NICE_ENV}=0"
    enabled = proc / _AUTOGROUP_ENABLED.relative_to("/proc")
    try:
        if enabled.read_text().strip() != "1":
            return "autogroup scheduling is off (kernel.sched_autogroup_enabled)"
    except OSError:
        return f"no {enabled}"
    path = proc / str(pid) / "autogroup"
    deadline = time.monotonic() + retry_s
    while True:
        try:
            path.write_text(f"{nice}\n")
            return None
        except OSError as e:
            if e.errno == errno.EAGAIN and time.monotonic() < deadline:
                time.sleep(0.02)  # another autogroup write in the last 100 ms
                continue
            return f"{path}: {e.strerror or e}"


def describe_exit(returncode: int) -> str:
    """``exit 3`` or ``killed by SIGKILL``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


@dataclass
class Child:
    """One supervised process, rendered from its :class:`ProcessSpec`."""

    name: str
    process: ProcessSpec
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    """Environment of this machine on top of the process's own (caches, offline mode)."""
    nice: int = 0
    """Niceness added to the process (and everything it starts): lower CPU priority when
    it competes for this machine's cores with the other children. Applied to the
    process and, where the kernel groups by session, to its session's autogroup
    (:func:`set_autogroup_nice`), which is what counts there."""
    nice_scope: str = ""
    """Where ``nice`` took effect at the last start: ``autogroup`` (the session's and the
    process's), ``process`` (the process's only) or empty (``nice`` 0)."""
    proc: subprocess.Popen[bytes] | None = None
    started_s: float = 0.0
    """When it last started, on the supervisor's clock."""
    restarts: int = 0
    quick_deaths: int = 0
    """Deaths in a row, each soon after its start (see :class:`RestartPolicy`)."""
    restart_at_s: float | None = None
    """When a dead child is due to start again; None while it runs."""

    @property
    def cmd(self) -> list[str]:
        return self.process.argv

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.process.port}"

    def start(self) -> None:
        # Appended: a restarted child's log follows the one that died, with a marker.
        log = self.log_path.open("ab")
        if self.restarts:
            log.write(f"\n--- flowprefill up: restart {self.restarts} ---\n".encode())
            log.flush()
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            # The user's environment may override what the process description sets.
            env={**self.process.env, **os.environ, **self.env},
            start_new_session=True,  # Ctrl-C reaches the supervisor, which stops us in order
            preexec_fn=_niceness(self.nice),
        )
        log.close()  # the child holds its own descriptor
        self.restart_at_s = None
        self._apply_autogroup_nice()

    def _apply_autogroup_nice(self) -> None:
        # Popen returned after the child's exec, so it is already in its own session; what
        # it starts from here on inherits the session (and so its autogroup's nice).
        if self.nice <= 0 or self.proc is None:
            self.nice_scope = ""
            return
        why_not = set_autogroup_nice(self.proc.pid, self.nice, {**os.environ, **self.env})
        if why_not is None:
            self.nice_scope = "autogroup"
            log.info("%s: nice %d on its session's autogroup", self.name, self.nice)
        else:
            self.nice_scope = "process"
            log.info("%s: nice %d on the process only (%s)", self.name, self.nice, why_not)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill_leftovers(self) -> None:
        """SIGKILL whatever the dead process left in its process group — its own children,
        such as vLLM's engine core and workers, which outlive a killed API server — as a
        pod's death takes all its processes. Left alone they keep their memory and cores
        beside the restarted child's own. The group is the child's (``start_new_session``),
        and a process group's id is not reused while any member lives."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):  # nothing left behind
            os.killpg(self.proc.pid, signal.SIGKILL)

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + self.process.ready_path, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)  # a stopped child could not act on SIGTERM
        self.proc.send_signal(signal.SIGTERM)  # graceful: drain in-flight requests
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class CrashLoopError(Exception):
    """A child died ``max_quick_deaths`` times in a row soon after starting."""


class Supervisor:
    """Owns the children's lifecycles: :meth:`start_all`, then :meth:`tick` periodically
    (deaths noticed, restarts due started), then :meth:`stop_all`."""

    def __init__(
        self,
        children: list[Child],
        console: Console,
        policy: RestartPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.children = children
        self.console = console
        self.policy = policy or RestartPolicy()
        self.clock = clock

    def start_all(self, timeout_s: float, stopping: Callable[[], bool]) -> str | None:
        """Start every child and wait until each is ready; None when all are, else why not
        (a child died during start-up, the timeout passed, or ``stopping()`` turned true)."""
        for c in self.children:
            self._start(c)
        deadline = self.clock() + timeout_s
        with self.console.status("starting") as status:
            pending = list(self.children)
            while pending:
                if stopping():
                    return "stopped during start-up"
                for c in list(pending):
                    if not c.alive():
                        return f"{c.name} exited during start-up\n{c.log_tail()}"
                    if c.ready():
                        pending.remove(c)
                status.update("waiting for " + ", ".join(c.name for c in pending))
                if pending and self.clock() > deadline:
                    names = ", ".join(c.name for c in pending)
                    return f"not ready after {timeout_s:.0f} s: {names}"
                if pending:
                    time.sleep(0.5)
        return None

    def tick(self) -> None:
        """Notice children that died and start those whose back-off is over. Raises
        :class:`CrashLoopError` when one died too often in a row."""
        now = self.clock()
        for c in self.children:
            if c.restart_at_s is not None:
                if now >= c.restart_at_s:
                    c.restarts += 1
                    self._start(c)
                    self.console.print(f"[green]{c.name} restarted[/green] (restart {c.restarts})")
                continue
            if c.proc is None or c.proc.poll() is None:
                continue
            c.kill_leftovers()
            quick = now - c.started_s < self.policy.stable_after_s
            c.quick_deaths = c.quick_deaths + 1 if quick else 1
            how = describe_exit(c.proc.returncode)
            limit = self.policy.max_quick_deaths
            if limit and c.quick_deaths >= limit:
                raise CrashLoopError(
                    f"{c.name} died {c.quick_deaths} times in a row, each within "
                    f"{self.policy.stable_after_s:.0f} s of starting (last: {how})\n"
                    f"{c.log_tail()}"
                )
            backoff = self.policy.backoff_s(c.quick_deaths)
            c.restart_at_s = now + backoff
            self.console.print(
                f"[yellow]{c.name} died ({how})[/yellow]; restarting in {backoff:.0f} s "
                f"(log: {c.log_path})\n{c.log_tail(5)}"
            )

    def _start(self, c: Child) -> None:
        c.start()
        c.started_s = self.clock()

    def stop_all(self) -> None:
        for c in reversed(self.children):  # gateway first: no new requests while others drain
            c.restart_at_s = None
            c.stop()
