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
    it competes for this machine's cores with the other children."""
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
