"""The in-pod launcher of a ``role: colocated`` ServingPool: prefill engine and vLLM decode
as two processes of one container, sharing its GPU(s).

Why one container: the NVIDIA device plugin mounts a GPU into the one container that
requests it, so two containers of a pod cannot share it on a plain GPU cluster (a DRA
ResourceClaim could, where the cluster has DRA; docs/operator.md, "Colocated pools"). The
decode image carries both vLLM and FlowPrefill, so the container runs this launcher there:

``python -m flowprefill_operator.colocated run '<LaunchSpec JSON>'``

* prefill starts first (its torch allocator capped at its share of the GPU with
  ``cap-memory``, below); decode starts once prefill answers its ready path, so vLLM's
  start-up memory profiling sees prefill's memory already taken and its
  ``--gpu-memory-utilization`` budget is checked against what is really free;
* when either process exits, the other is stopped (SIGTERM, SIGKILL after
  ``stop_timeout_s``) and the launcher exits with the dead one's code, so the kubelet
  restarts the container as it would a one-process pod;
* SIGTERM (the pod going away) is forwarded to both, each drains by its own bound, and the
  launcher exits when both have;
* the container's probes ask the launcher (``health_port``): ``/health`` is 200 while both
  processes answer their health paths, ``/ready`` while both answer their ready paths.

Standard library only (it runs in the decode image, which has no kopf); ``cap-memory``
imports torch, which that image has.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import entry_points
from typing import Any

LAUNCHER_MODULE = "flowprefill_operator.colocated"
POLL_S = 0.5
PROBE_TIMEOUT_S = 2.0
DEFAULT_STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Child:
    """One process of the pod: its argv and own environment (added to the container's),
    the port it listens on (on every interface; probed on 127.0.0.1) and its probe paths.
    ``memory_fraction``: cap its torch CUDA allocator at this share of its GPU."""

    name: str
    argv: list[str]
    port: int
    ready_path: str
    health_path: str
    env: dict[str, str] = field(default_factory=dict)
    memory_fraction: float | None = None

    @classmethod
    def parse(cls, name: str, raw: object) -> Child:
        """A child from its JSON object; a clear error naming the field on bad input."""
        if not isinstance(raw, dict):
            raise ValueError(f"{name}: expected an object, got {type(raw).__name__}")
        argv, env, fraction = raw.get("argv"), raw.get("env", {}), raw.get("memory_fraction")
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise ValueError(f"{name}.argv: expected a non-empty list of strings")
        if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
            raise ValueError(f"{name}.env: expected an object of strings")
        if fraction is not None and not (isinstance(fraction, int | float) and 0 < fraction < 1):
            raise ValueError(f"{name}.memory_fraction: expected a number in (0, 1)")
        port = raw.get("port")
        if not (isinstance(port, int) and 0 < port < 65536):
            raise ValueError(f"{name}.port: expected a TCP port")
        paths = {k: raw.get(k) for k in ("ready_path", "health_path")}
        for key, value in paths.items():
            if not (isinstance(value, str) and value.startswith("/")):
                raise ValueError(f"{name}.{key}: expected a path starting with /")
        return cls(
            name=name,
            argv=list(argv),
            port=port,
            ready_path=str(paths["ready_path"]),
            health_path=str(paths["health_path"]),
            env=dict(env),
            memory_fraction=None if fraction is None else float(fraction),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "argv": self.argv,
            "env": self.env,
            "port": self.port,
            "ready_path": self.ready_path,
            "health_path": self.health_path,
            "memory_fraction": self.memory_fraction,
        }

    def command(self) -> list[str]:
        """What to execute: the argv, or with a memory cap the argv under ``cap-memory``."""
        if self.memory_fraction is None:
            return list(self.argv)
        return [sys.executable, "-m", LAUNCHER_MODULE, "cap-memory",
                str(self.memory_fraction), "--", *self.argv]  # fmt: skip


@dataclass(frozen=True)
class LaunchSpec:
    """What the operator renders into the container's command (``run``'s argument)."""

    prefill: Child
    decode: Child
    health_port: int
    """The launcher's own probe port (the operator's
    ``flowprefill.contracts.deployment.COLOCATED_HEALTH_PORT``; not imported here: the
    launcher imports nothing but the standard library)."""
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S

    @classmethod
    def parse(cls, text: str) -> LaunchSpec:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"launch spec is not JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError("launch spec: expected a JSON object")
        unknown = set(raw) - {"prefill", "decode", "health_port", "stop_timeout_s"}
        if unknown:
            raise ValueError(f"launch spec: unknown keys {sorted(unknown)}")
        prefill = Child.parse("prefill", raw.get("prefill"))
        decode = Child.parse("decode", raw.get("decode"))
        port = raw.get("health_port")
        stop = raw.get("stop_timeout_s", DEFAULT_STOP_TIMEOUT_S)
        if not (isinstance(port, int) and 0 < port < 65536):
            raise ValueError("health_port: expected a TCP port (the launcher's probe port)")
        if not (isinstance(stop, int | float) and stop > 0):
            raise ValueError("stop_timeout_s: expected a positive number")
        return cls(
            prefill=prefill,
            decode=decode,
            health_port=port,
            stop_timeout_s=float(stop),
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "prefill": self.prefill.to_json(),
                "decode": self.decode.to_json(),
                "health_port": self.health_port,
                "stop_timeout_s": self.stop_timeout_s,
            },
            separators=(",", ":"),
        )


def answers(port: int, path: str) -> bool:
    """Whether ``http://127.0.0.1:port/path`` answers 200 within :data:`PROBE_TIMEOUT_S`."""
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}{path}", timeout=PROBE_TIMEOUT_S
        ) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _log(message: str) -> None:
    print(f"colocated: {message}", file=sys.stderr, flush=True)


class Launcher:
    """Runs the two children (see the module's docstring); :meth:`run` returns the exit
    code of the container."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopping = threading.Event()
        # Re-entrant: the SIGTERM handler runs on the main thread, possibly while that
        # thread holds the lock.
        self._lock = threading.RLock()

    # --- probes ---------------------------------------------------------------------------
    def _all_answer(self, ready: bool) -> tuple[bool, str]:
        with self._lock:
            procs = dict(self.procs)
        for child in (self.spec.prefill, self.spec.decode):
            proc = procs.get(child.name)
            if proc is None:
                return False, f"{child.name} not started"
            if proc.poll() is not None:
                return False, f"{child.name} exited ({proc.returncode})"
            path = child.ready_path if ready else child.health_path
            if not answers(child.port, path):
                return False, f"{child.name} does not answer {path}"
        return True, "ok"

    def probe(self, path: str) -> tuple[int, str]:
        """The launcher's answer on ``path``: /health and /ready (module docstring)."""
        if path not in ("/health", "/ready"):
            return 404, "not found"
        if self.stopping.is_set():
            return 503, "stopping"
        ok, why = self._all_answer(ready=path == "/ready")
        return (200 if ok else 503), why

    def _serve_probes(self) -> ThreadingHTTPServer:
        launcher = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                code, text = launcher.probe(self.path.split("?", 1)[0])
                body = (text + "\n").encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # one line per kubelet probe would drown the processes' logs

        server = ThreadingHTTPServer(("", self.spec.health_port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="probes", daemon=True).start()
        return server

    # --- processes ------------------------------------------------------------------------
    def _start(self, child: Child) -> None:
        _log(f"starting {child.name}: {' '.join(child.argv)}")
        proc = subprocess.Popen(child.command(), env={**os.environ, **child.env})
        with self._lock:
            self.procs[child.name] = proc
        if self.stopping.is_set():  # SIGTERM came while it was starting: it drains too
            proc.send_signal(signal.SIGTERM)

    def _signal_all(self, sig: signal.Signals) -> None:
        with self._lock:
            procs = list(self.procs.items())
        for name, proc in procs:
            if proc.poll() is None:
                _log(f"sending {sig.name} to {name}")
                proc.send_signal(sig)

    def _on_sigterm(self, signum: int, _frame: object) -> None:
        self.stopping.set()
        self._signal_all(signal.Signals(signum))

    def _stop_rest(self) -> None:
        """Another child died: SIGTERM the rest, SIGKILL what outlives stop_timeout_s."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.spec.stop_timeout_s
        with self._lock:
            procs = list(self.procs.values())
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, self._on_sigterm)
        server = self._serve_probes()
        try:
            self._start(self.spec.prefill)
            while True:
                with self._lock:
                    procs = list(self.procs.items())
                exited = [(n, p.returncode) for n, p in procs if p.poll() is not None]
                if self.stopping.is_set():
                    if len(exited) == len(procs):
                        _log("both processes have stopped")
                        return 0
                elif exited:
                    name, code = exited[0]
                    _log(f"{name} exited with {code}: stopping the other process")
                    self._stop_rest()
                    # An exit of 0 is unexpected too: the pod must not keep running half.
                    return code if code else 1
                elif "decode" not in self.procs and answers(
                    self.spec.prefill.port, self.spec.prefill.ready_path
                ):
                    self._start(self.spec.decode)
                time.sleep(POLL_S)
        finally:
            server.shutdown()
            server.server_close()


def run_console_script(argv: list[str]) -> int:
    """Run ``argv`` in this process (where :func:`cap_memory` holds): ``argv[0]`` must be an
    installed console script (the image's ``flowprefill``), called with ``sys.argv`` =
    ``argv``; anything else is refused."""
    if not argv:
        raise ValueError("cap-memory: nothing to run after --")
    found = entry_points(group="console_scripts", name=argv[0])
    if not found:
        raise ValueError(f"cap-memory: {argv[0]!r} is not an installed console script")
    main = next(iter(found)).load()
    sys.argv = list(argv)
    result = main()
    return result if isinstance(result, int) else 0


def cap_memory(fraction: float) -> None:
    """Cap this process's torch CUDA allocator at ``fraction`` of its current GPU's total
    memory; an allocation past it raises torch's out-of-memory error. Refuses without a
    GPU (a colocated pool without GPUs renders no cap)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("cap-memory: no CUDA device in this container (is a GPU requested?)")
    device = torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    total = torch.cuda.get_device_properties(device).total_memory
    _log(f"prefill capped at {fraction:g} of cuda:{device} ({fraction * total / 2**30:.1f} GiB)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {LAUNCHER_MODULE}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run prefill and decode (a colocated pod's command)")
    run.add_argument("spec", help="the launch spec (JSON)")
    cap = sub.add_parser(
        "cap-memory", help="cap the torch CUDA allocator, then run a console script in-process"
    )
    cap.add_argument("fraction", type=float, help="share of the GPU's total memory, (0, 1)")
    cap.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the console script's argv")
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return Launcher(LaunchSpec.parse(args.spec)).run()
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not 0 < args.fraction < 1:
            raise ValueError(f"cap-memory: fraction must be in (0, 1), got {args.fraction}")
        cap_memory(args.fraction)
        return run_console_script(command)
    except (ValueError, RuntimeError) as e:
        print(f"colocated: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
