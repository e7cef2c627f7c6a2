"""Run the operator as ``kopf run`` in a subprocess against the emulator; poll for states."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from flowprefill_operator.kube import Kube
from kubernetes import client, config

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kube_for(kubeconfig: Path) -> Kube:
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    return Kube(client.ApiClient(cfg), timeout_s=10)


def wait_for(fn: Callable[[], T], timeout_s: float = 30.0, what: str = "") -> T:
    """Poll ``fn`` until it returns something truthy (exceptions count as not yet)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except AssertionError as e:
            last = e
        else:
            if last:
                return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what or fn}: last={last!r}")


class OperatorProcess:
    """``python -m kopf run -m flowprefill_operator.handlers -A`` with a liveness endpoint."""

    def __init__(
        self,
        kubeconfig: Path,
        log_path: Path,
        env: dict[str, str],
        peering: str | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.env = env
        self.peering = peering
        self.port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def probe_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/healthz"

    def start(self) -> OperatorProcess:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "FLOWPREFILL_OPERATOR_METRICS_PORT": str(self.metrics_port),
            **self.env,
        }
        cmd = [
            sys.executable,
            "-m",
            "kopf",
            "run",
            "-m",
            "flowprefill_operator.handlers",
            "--all-namespaces",
            f"--liveness={self.probe_url}",
            f"--peering={self.peering}" if self.peering else "--standalone",
        ]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: self.probe() is not None, 60, "the operator's liveness probe")
        return self

    def probe(self) -> dict[str, Any] | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"operator exited ({self.proc.returncode}); see {self.log_path}")
        try:
            with urllib.request.urlopen(self.probe_url, timeout=2) as resp:
                data: dict[str, Any] = json.loads(resp.read())
                return data
        except OSError:
            return None

    def metrics(self) -> str:
        """The operator's own /metrics text."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text: str = resp.read().decode()
        return text

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")
