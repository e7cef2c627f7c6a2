"""The ranks of one tensor-parallel prefill instance: spawning, commands, faults.

``flowprefill serve-prefill`` with ``tp_size = N`` is one process, rank 0 (the *leader*),
that spawns ranks 1..N-1 (*followers*) on the same machine — one container per pod, no
``torchrun``. Every rank joins one ``torch.distributed`` group (gloo on CPU, NCCL on CUDA,
rank ``r`` on ``cuda:<index + r>``) for the model's own collectives, loads its shard
(:mod:`flowprefill.prefill.tp.shard`) and builds the same preemptible executor.

Only the leader owns the HTTP server, the scheduler and the execution pool. Followers run
what it sends, in order, over one pipe each:

``submit(key, slot, prompts)``
    start task ``key`` on a new thread, gated by the shared agreement table's slot;
``resume(key)`` / ``cancel(key)``
    release the task parked at the agreed checkpoint (or unwind it);
``report()`` / ``stop()``
    where each task parked (tests, benchmarks) / shut down.

(Preempt needs no command: the target checkpoint travels through the shared table of
:mod:`flowprefill.prefill.tp.agreement`.) Commands go over pipes, not a gloo broadcast: a follower
waits for the next command for arbitrarily long, which a collective's timeout would turn
into a failure, and a pipe reports a dead peer at once (EOF).

A follower starts or resumes a task only once its previous task has parked or finished,
so on every rank the model's collectives come in the same order: the leader's scheduler
runs one task at a time and ACKs a preemption only when all ranks have parked.

Faults: the leader's monitor thread waits on every follower's process sentinel. A follower
that exits (crash, OOM kill, SIGKILL) fails the instance: in-flight requests get
:class:`~flowprefill.errors.RankFailedError` (HTTP 503 naming the rank and its exit code),
readiness fails, and the server exits so the pod restarts. A follower whose leader is gone
sees EOF on its pipe (or an error in a collective) and exits. A task that raises on a
follower (anything but cancellation) kills that follower: the ranks' states have diverged.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from flowprefill.contracts import EngineConfig
from flowprefill.contracts.names import RankCommand
from flowprefill.errors import KVHandoffError, RankFailedError, TaskCancelledError
from flowprefill.kv.format import DTYPES
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.executor.splitting import SplitRates
from flowprefill.prefill.tp.agreement import FollowerGate, SharedTable
from flowprefill.prefill.tp.kv_ranks import FollowerKV, gather_kv_heads, nixl_enabled

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 600.0
"""A collective only waits for ranks running the same task (parked tasks sit in no
collective), so a long wait means a rank is stuck; the monitor usually fails sooner."""

START_TIMEOUT_S = 600.0
"""Followers load their shard in parallel with the leader; this bounds the whole start."""

COMMAND_WAIT_S = 600.0
"""How long a follower waits for its previous task to park before taking a command."""


@dataclass(frozen=True)
class RankSpec:
    """What a follower process needs (pickled to it at spawn)."""

    config: EngineConfig
    rank: int
    world: int
    master_port: int
    table: SharedTable
    conn: Connection
    kv_notifications: Any = None
    """NIXL transport: where this rank forwards consumers' notifications to rank 0."""


def rank_device(device: str, rank: int) -> torch.device:
    """``cuda`` / ``cuda:i`` → rank ``r`` on ``cuda:i+r``; CPU ranks share the CPU."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def rank_threads(config: EngineConfig) -> int:
    """Intra-op threads per rank: the configured count, else the cores split N ways."""
    if config.num_threads is not None:
        return config.num_threads
    return max(1, (os.cpu_count() or 1) // config.tp_size)


def init_rank(config: EngineConfig, rank: int, master_port: int) -> PreemptibleExecutor:
    """Join the instance's process group and build this rank's executor on its shard."""
    from flowprefill.models.loader import resolve_model_path
    from flowprefill.prefill.tp.shard import Shard, install_all_reduces, load_shard

    device = rank_device(config.device, rank)
    if device.type == "cpu":
        torch.set_num_threads(rank_threads(config))
    else:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{master_port}",
        rank=rank,
        world_size=config.tp_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    path = resolve_model_path(config.model_path)
    model = load_shard(path, Shard(rank, config.tp_size), dtype=DTYPES[config.dtype], device=device)
    install_all_reduces(model)
    executor = PreemptibleExecutor(
        model,
        granularity=config.granularity,
        chunk_size=config.chunk_size,
        device=device,
        kernels=config.resolved_kernels(),
        # NIXL: every rank serves its own heads (kv_ranks.py); nothing gathered.
        kv_gather=None if nixl_enabled(config) else gather_kv_heads,
        max_blocking_ms=config.resolved_max_blocking_ms(),
        sync=config.device_sync,
    )
    policy = executor.split_policy
    if policy is not None:
        # Every rank must split alike (they park at the same checkpoint number): all
        # predict with rank 0's measured rates and GEMM profiles. Each rank measured its
        # own, so the sizes may differ: the length goes first.
        mine = policy.rates.to_vector()
        size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
        dist.broadcast(size, src=0)
        values = torch.zeros(int(size.item()), dtype=torch.float64, device=device)
        if rank == 0:
            values.copy_(torch.tensor(mine, dtype=torch.float64))
        dist.broadcast(values, src=0)
        executor.set_split_rates(SplitRates.from_vector(values.tolist()))
    return executor


# --------------------------------------------------------------------- followers


class _Follower:
    """A follower's command loop and its task threads."""

    def __init__(
        self, spec: RankSpec, executor: PreemptibleExecutor, kv: FollowerKV | None = None
    ) -> None:
        self.spec, self.executor, self.kv = spec, executor, kv
        self.controls: dict[int, TaskControl] = {}
        self.gates: dict[int, FollowerGate] = {}

    def serve(self) -> None:
        conn = self.spec.conn
        while True:
            try:
                command, *args = conn.recv()
            except (EOFError, OSError):
                _die(f"rank {self.spec.rank}: the leader rank is gone")
            if command == RankCommand.STOP:
                return
            if command == RankCommand.REPORT:
                conn.send({key: list(g.parked_at) for key, g in self.gates.items()})
                continue
            if command == RankCommand.PUBLISH_KV:  # touches no task: no need to settle
                conn.send(self._publish_kv(*args))
                continue
            self._settle()
            if command == RankCommand.SUBMIT:
                self._submit(*args)
            elif command == RankCommand.RESUME:
                self.controls[args[0]].resume()
            elif command == RankCommand.CANCEL:
                self.controls[args[0]].cancel()
            else:
                _die(f"rank {self.spec.rank}: unknown command {command!r}")

    def _publish_kv(self, digest: str, block_ids: list[int]) -> tuple[str, str]:
        if self.kv is None:
            return ("error", f"rank {self.spec.rank} has no NIXL buffer")
        try:
            self.kv.publish(digest, block_ids)
        except Exception as e:
            return ("error", f"rank {self.spec.rank}: {type(e).__name__}: {e}")
        return ("ok", "")

    def _settle(self) -> None:
        """Wait until no task of this rank is running (all parked or done)."""
        for key, control in list(self.controls.items()):
            if control.done:
                del self.controls[key]
                continue
            if not control.wait_parked_or_done(COMMAND_WAIT_S):
                _die(f"rank {self.spec.rank}: task {key} reached no checkpoint in time")

    def _submit(self, key: int, slot: int, prompts: Sequence[Sequence[int]]) -> None:
        control = TaskControl(name=f"task-{key}@rank{self.spec.rank}")
        gate = FollowerGate(self.spec.table, slot, self.spec.rank)
        control.gate = gate
        self.controls[key], self.gates[key] = control, gate
        if len(self.gates) > 4 * self.spec.table.slots:  # keep the report bounded
            self.gates.pop(next(iter(self.gates)))

        def main() -> None:
            try:
                outputs = self.executor.run(prompts, control)
                if self.kv is not None:
                    self.kv.keep(prompts, outputs)
            except TaskCancelledError:
                pass
            except BaseException:
                log.exception("rank %d: task %d failed", self.spec.rank, key)
                _die(f"rank {self.spec.rank}: task {key} failed; ranks have diverged")
            finally:
                control.mark_done()

        threading.Thread(target=main, name=f"tp-task-{key}", daemon=True).start()


def _die(message: str) -> Any:
    log.error("%s: exiting", message)
    logging.shutdown()
    os._exit(1)


def follower_main(spec: RankSpec) -> None:
    """Entry point of a follower process."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{spec.rank} %(levelname)s %(message)s"
    )
    kv: FollowerKV | None = None
    try:
        executor = init_rank(spec.config, spec.rank, spec.master_port)
        if nixl_enabled(spec.config):
            kv = FollowerKV(
                spec.config, spec.rank, executor.model.config, executor.device,
                spec.kv_notifications,
            )  # fmt: skip
    except BaseException as e:  # reported to the leader, which fails the start with it
        spec.conn.send(("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    spec.conn.send(("ready", kv.metadata() if kv is not None else None))
    _Follower(spec, executor, kv).serve()
    dist.destroy_process_group()


# ------------------------------------------------------------------------ leader


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RankGroup:
    """The leader's view of its followers: spawns them, sends commands, watches them.

    ``on_failure(error)`` callbacks run once, on the monitor thread, when a follower exits
    while the group is open.
    """

    def __init__(self, config: EngineConfig) -> None:
        import multiprocessing

        if config.tp_size < 2:
            raise ValueError("a RankGroup needs tp_size >= 2")
        from flowprefill.models.loader import resolve_model_path

        ctx = multiprocessing.get_context("spawn")
        # Resolved once, here: a built-in name is materialised before any rank reads it.
        path = str(resolve_model_path(config.model_path))
        config = config.model_copy(update={"model_path": path})
        self.config = config
        self.world = config.tp_size
        self.table = SharedTable(self.world, ctx=ctx)
        self._send_lock = threading.Lock()
        self._fail_lock = threading.Lock()
        self._failure: RankFailedError | None = None
        self._failed = threading.Event()
        self._callbacks: list[Callable[[RankFailedError], None]] = []
        self._closing = False
        port = free_port()
        self._conns: list[Connection] = []
        self.processes = []
        self.kv_notifications = ctx.Queue() if nixl_enabled(config) else None
        self.kv_peers: dict[int, dict[str, Any]] = {}
        """NIXL transport: each follower's agent metadata, by rank."""
        for rank in range(1, self.world):
            ours, theirs = ctx.Pipe()
            spec = RankSpec(
                config, rank, self.world, port, self.table, theirs, self.kv_notifications
            )
            proc = ctx.Process(
                target=follower_main, args=(spec,), name=f"flowprefill-rank{rank}", daemon=True
            )
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self.processes.append(proc)
        try:
            self.executor = self._start_leader(port)
        except BaseException:
            self._kill_all()
            raise
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()

    def _start_leader(self, port: int) -> PreemptibleExecutor:
        result: list[PreemptibleExecutor] = []
        errors: list[BaseException] = []

        def start() -> None:
            try:
                result.append(init_rank(self.config, 0, port))
            except BaseException as e:
                errors.append(e)

        # On a thread so that a follower failing to start is noticed while rank 0 sits
        # in init_process_group waiting for it.
        starter = threading.Thread(target=start, name="tp-leader-start", daemon=True)
        starter.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = dict(zip(self._conns, range(1, self.world), strict=True))
        while pending or starter.is_alive():
            if time.monotonic() > deadline:
                raise RankFailedError(f"tensor-parallel ranks did not start in {START_TIMEOUT_S}s")
            sentinels = {p.sentinel: r for r, p in enumerate(self.processes, start=1)}
            ready = wait([*pending, *sentinels], timeout=0.2)
            for item in ready:
                if item in pending:
                    conn = item
                    assert isinstance(conn, Connection)
                    status, detail = conn.recv()
                    if status != "ready":
                        raise RankFailedError(f"tensor-parallel rank {pending[conn]}: {detail}")
                    if detail is not None:
                        self.kv_peers[pending[conn]] = detail
                    del pending[conn]
                elif item in sentinels and any(c for c in pending if pending[c] == sentinels[item]):
                    proc = self.processes[sentinels[item] - 1]
                    raise RankFailedError(
                        f"tensor-parallel rank {sentinels[item]} exited with code "
                        f"{proc.exitcode} while starting"
                    )
            if not starter.is_alive() and errors:
                raise errors[0]
        if errors:
            raise errors[0]
        return result[0]

    # ----------------------------------------------------------------- commands

    def send(self, *command: Any) -> None:
        """Deliver ``command`` to every follower (in the same order on each)."""
        self.check_alive()
        with self._send_lock:
            for rank, conn in enumerate(self._conns, start=1):
                try:
                    conn.send(command)
                except (BrokenPipeError, ConnectionResetError, OSError) as e:
                    # Name the rank: a send can notice a dead rank before the watcher does,
                    # and the first failure is the one every later caller sees.
                    raise self._fail(self._unreachable(rank, e)) from e

    def publish_kv(self, digest: str, block_ids: list[int]) -> None:
        """Every follower lays out its heads of the prompt ``digest`` in ``block_ids``;
        returns once all have (the consumer may read as soon as it has the answer)."""
        self.check_alive()
        with self._send_lock:
            for conn in self._conns:
                conn.send((RankCommand.PUBLISH_KV, digest, block_ids))
            replies = [conn.recv() for conn in self._conns]
        errors = [detail for status, detail in replies if status != "ok"]
        if errors:
            raise KVHandoffError("; ".join(errors))

    def drain_kv_notifications(self) -> list[tuple[int, str]]:
        """(rank, message) of the NIXL notifications followers received since last call."""
        out: list[tuple[int, str]] = []
        if self.kv_notifications is None:
            return out
        while True:
            try:
                out.append(self.kv_notifications.get_nowait())
            except queue.Empty:
                return out

    def reports(self) -> list[dict[int, list[int]]]:
        """Per follower: checkpoint numbers at which each task parked."""
        with self._send_lock:
            for conn in self._conns:
                conn.send((RankCommand.REPORT,))
            return [conn.recv() for conn in self._conns]

    def _unreachable(self, rank: int, error: BaseException) -> str:
        proc = self.processes[rank - 1]
        proc.join(timeout=0.5)  # a broken pipe usually means the process is exiting
        how = f"exited with code {proc.exitcode}" if proc.exitcode is not None else "is alive"
        return (
            f"tensor-parallel rank {rank} (pid {proc.pid}) stopped reading commands "
            f"({error}); it {how}"
        )

    def check_alive(self) -> None:
        if self._failure is not None:
            raise self._failure

    @property
    def failure(self) -> RankFailedError | None:
        return self._failure

    def wait_failure(self, timeout_s: float) -> RankFailedError | None:
        """The group's failure, waiting up to ``timeout_s`` for the watcher to record one: a
        collective on the leader can fail (gloo's connection reset) a moment before the
        watcher sees the dead rank's process end."""
        self._failed.wait(timeout_s)
        return self._failure

    def on_failure(self, callback: Callable[[RankFailedError], None]) -> None:
        self._callbacks.append(callback)
        if self._failure is not None:
            callback(self._failure)

    # ------------------------------------------------------------------- faults

    def _watch(self) -> None:
        sentinels = {p.sentinel: (r, p) for r, p in enumerate(self.processes, start=1)}
        ready = wait(list(sentinels))
        if self._closing:
            return
        rank, proc = sentinels[ready[0]]  # type: ignore[index]
        proc.join(1.0)
        self._fail(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")

    def _fail(self, message: str) -> RankFailedError:
        with self._fail_lock:
            first = self._failure is None
            if first:
                self._failure = RankFailedError(f"{message}; this prefill instance is down")
                self._failed.set()
        assert self._failure is not None
        if first:
            log.error("%s", self._failure)
            for callback in self._callbacks:
                try:
                    callback(self._failure)
                except Exception:
                    log.exception("rank-failure callback failed")
        return self._failure

    def _kill_all(self) -> None:
        self._closing = True
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the followers (politely, then by force) and leave the process group."""
        if self._closing:
            return
        self._closing = True
        if self._failure is None:
            try:
                with self._send_lock:
                    for conn in self._conns:
                        conn.send((RankCommand.STOP,))
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a dead peer can make the teardown itself fail
                log.debug("destroy_process_group failed", exc_info=True)
