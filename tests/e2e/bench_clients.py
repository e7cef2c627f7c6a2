"""Pinned installs of third-party benchmark clients, one virtual environment per tool.

:func:`client_venv` gives the venv of one of :data:`CLIENTS` (guidellm, aiperf,
inference-perf), built under the repository's ``.cache/bench-clients/<tool>-<version>``
(git-ignored) the first time, and reused while its stamp names the same requirements and
Python; CI's fresh clone builds them from scratch. Each tool gets its own venv because
their pins clash (inference-perf pins ``transformers==5.13.0`` and needs Python >= 3.12;
guidellm depends on plain ``torch``).

Contracts:

- guidellm's plain ``torch`` requirement is installed in the same pip command as
  ``torch==2.13.0``, which resolves to the CPU build on this machine's disk (Python 3.11
  only). After the install, no CUDA package (``nvidia-*`` other than ``nvidia-ml-py``,
  aiperf's pure-Python NVML binding) may be in any venv, and guidellm's torch must be a
  ``+cpu`` build: otherwise :class:`InstallError`.
- A failed install (no network, a pin that cannot resolve) raises :class:`InstallError`
  carrying pip's output: a test fails on it, it never skips.
- Only a missing interpreter is a skip: :class:`NoPythonError` (inference-perf needs a
  CPython 3.12: ``$FLOWPREFILL_PYTHON312``, ``python3.12`` on PATH, or pyenv's;
  guidellm a CPython 3.11, the one torch's CPU build on disk is for: the running one,
  else ``python3.11`` on PATH or pyenv's).
- Progress (each step, pip's own lines, the elapsed time) goes to stdout as it happens,
  so ``pytest -s`` shows a long first install moving.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "bench-clients"
PYTHON312_VAR = "FLOWPREFILL_PYTHON312"


class InstallError(RuntimeError):
    """A client's venv could not be built; the message carries the command's output."""


class NoPythonError(RuntimeError):
    """The Python version a client needs is not on this machine (a reason to skip)."""


@dataclass(frozen=True)
class Client:
    """A benchmark client: its pip requirements (the first names the tool and its
    version), the console script it runs as, and the Python minor version it needs
    (``None``: the one running the tests)."""

    name: str
    requirements: tuple[str, ...]
    script: str
    python: tuple[int, int] | None = None

    @property
    def key(self) -> str:
        """``<tool>-<version>``: the cache directory's name."""
        return self.requirements[-1].replace("==", "-")


CLIENTS: dict[str, Client] = {
    # torch pinned in the same command: guidellm asks for plain torch, which would
    # otherwise resolve to PyPI's newest (a CUDA build, several GB). The CPU build on
    # this machine's disk is for CPython 3.11 only, hence that Python.
    "guidellm": Client(
        "guidellm", ("torch==2.13.0", "guidellm==0.8.1"), "guidellm", python=(3, 11)
    ),
    "aiperf": Client("aiperf", ("aiperf==0.13.0",), "aiperf"),
    "inference-perf": Client(
        "inference-perf", ("inference-perf==0.7.0",), "inference-perf", python=(3, 12)
    ),
}

# nvidia-ml-py is NVML's Python binding (aiperf's GPU telemetry): pure Python, no CUDA.
ALLOWED_NVIDIA = {"nvidia-ml-py"}


def _is_python(candidate: str, version: tuple[int, int]) -> bool:
    done = subprocess.run(
        [candidate, "-c", f"import sys; print(sys.version_info[:2] == {version!r})"],
        capture_output=True,
        text=True,
    )
    # pyenv's shim answers for whichever version is selected, hence the question.
    return done.returncode == 0 and done.stdout.strip() == "True"


def find_python(version: tuple[int, int] | None) -> str:
    """An interpreter of ``version`` (``None``: this one). For 3.12:
    ``$FLOWPREFILL_PYTHON312``, ``python3.12`` on PATH, then pyenv's ``versions/3.12*``.
    Raises :class:`NoPythonError` naming where it looked."""
    if version is None or sys.version_info[:2] == version:
        return sys.executable
    dotted = f"{version[0]}.{version[1]}"
    candidates = [os.environ.get(PYTHON312_VAR) if version == (3, 12) else None]
    candidates.append(shutil.which(f"python{dotted}"))
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += sorted(str(p) for p in pyenv_root.glob(f"versions/{dotted}*/bin/python{dotted}"))
    for candidate in candidates:
        if candidate and Path(candidate).exists() and _is_python(candidate, version):
            return candidate
    where = f"${PYTHON312_VAR}, " if version == (3, 12) else ""
    raise NoPythonError(
        f"no CPython {dotted} on this machine (looked at {where}python{dotted} on PATH, "
        f"{pyenv_root}/versions/{dotted}*): pyenv install {dotted}"
    )


def _run(argv: list[str], log: list[str], timeout_s: float) -> None:
    """Run ``argv``, echoing each output line (progress) and keeping it in ``log``;
    :class:`InstallError` with the output if it fails or outlives ``timeout_s``."""
    print("$", " ".join(argv), flush=True)
    log.append("$ " + " ".join(argv))
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        log.append(line.rstrip("\n"))
        if time.monotonic() > deadline:
            proc.kill()
            break
    code = proc.wait()
    if code != 0 or time.monotonic() > deadline:
        why = f"exited with {code}" if time.monotonic() <= deadline else f"ran past {timeout_s} s"
        tail = "\n".join(log[-200:])
        raise InstallError(f"{' '.join(argv)} {why}:\n{tail}")


def _stamp_text(client: Client, python: str) -> str:
    version = subprocess.run(
        [python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True
    ).stdout.strip()
    return "\n".join([*client.requirements, f"python {version}"]) + "\n"


def _check_installed(client: Client, venv: Path, log: list[str]) -> None:
    """No CUDA package landed; guidellm's torch is the CPU build."""
    listing = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
    )
    if listing.returncode != 0:
        raise InstallError(f"pip list failed in {venv}:\n{listing.stdout}{listing.stderr}")
    installed = dict(line.split("==", 1) for line in listing.stdout.splitlines() if "==" in line)
    cuda = sorted(
        name
        for name in installed
        if name.lower().startswith("nvidia-") and name.lower() not in ALLOWED_NVIDIA
    )
    if cuda:
        raise InstallError(f"{client.name}'s install pulled CUDA packages: {cuda}")
    torch = installed.get("torch")
    if torch is not None and not torch.endswith("+cpu"):
        raise InstallError(f"{client.name}'s install got torch {torch}, not the CPU build")
    log.append(f"checked: no CUDA package, torch {torch or 'absent'}")


def client_venv(name: str, *, timeout_s: float = 1800) -> Path:
    """The venv with client ``name`` of :data:`CLIENTS` installed (its console script is
    ``<venv>/bin/<script>``), built under :data:`CACHE` unless already there.

    Raises :class:`NoPythonError` when the Python it needs is missing,
    :class:`InstallError` when building it fails (pip's output in the message),
    ``KeyError`` for an unknown name."""
    if name not in CLIENTS:
        raise KeyError(f"unknown benchmark client {name!r}; known: {sorted(CLIENTS)}")
    client = CLIENTS[name]
    python = find_python(client.python)
    venv = CACHE / client.key
    stamp = venv / "flowprefill-stamp.txt"
    expected = _stamp_text(client, python)
    if stamp.is_file() and stamp.read_text() == expected:
        return venv
    started = time.monotonic()
    print(f"[bench-clients] installing {client.key} into {venv}", flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    log: list[str] = []
    _run([python, "-m", "venv", str(venv)], log, timeout_s=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--progress-bar", "off"]
    _run([*pip, *client.requirements], log, timeout_s=timeout_s)
    _check_installed(client, venv, log)
    if not (venv / "bin" / client.script).exists():
        raise InstallError(f"{client.name} installed without its {client.script} script")
    stamp.write_text(expected)  # last: a venv without it is rebuilt
    took = time.monotonic() - started
    print(f"[bench-clients] {client.key} installed in {took:.0f} s", flush=True)
    return venv


# --- `flowprefill up` and what its servers count --------------------------------------


@dataclass(frozen=True)
class Stack:
    """A running ``flowprefill up``: the gateway's URL, the model directory it serves
    (the tokenizer the clients are given), its decode instance's URL, its run folder."""

    url: str
    model_dir: Path
    decode_url: str
    run_dir: Path
    tmp: Path


@contextmanager
def demo_up(tmp: Path, model: str = "demo-llama") -> Iterator[Stack]:
    """``flowprefill up --model <model>`` (one prefill, one vLLM decode) started as a user
    starts it, its model cache and run folder under ``tmp`` and a linear TTFT profile (no
    start-up profiling); yields once it says it is up, stops it with Ctrl-C after.

    ``model_dir`` is :func:`flowprefill.models.named_model_dir`'s answer, checked equal
    to the ``tokenizer_path`` the gateway was configured with: a client given another
    tokenizer would count other tokens."""
    from flowprefill.models import named_model_dir
    from flowprefill.prefill.predictor.model import TTFTPredictor
    from tests.helpers import free_port

    model_dir = named_model_dir(model, cache_dir=tmp / "models")  # up finds it there
    profile = tmp / "profile.json"
    TTFTPredictor.linear(2e-5).save(profile)
    port = free_port()
    log = tmp / "up.log"
    run_dir = tmp / "run"
    env = {**os.environ, "FLOWPREFILL_MODEL_CACHE": str(tmp / "models")}
    # fmt: off
    cmd = [
        sys.executable, "-m", "flowprefill.cli", "up", "--model", model,
        "--prefill", "1", "--decode", "1", "--port", str(port),
        "--profile", str(profile), "--run-dir", str(run_dir),
    ]
    # fmt: on
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        while "is up" not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"up exited:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"up not ready:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)
        gateway = json.loads((run_dir / "gateway.json").read_text())
        assert Path(gateway["tokenizer_path"]) == model_dir, (gateway, model_dir)
        yield Stack(
            url=f"http://127.0.0.1:{port}",
            model_dir=model_dir,
            decode_url=gateway["decode"][0]["url"],
            run_dir=run_dir,
            tmp=tmp,
        )
    finally:
        proc.send_signal(signal.SIGINT)  # up stops its children in order
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _sum_samples(url: str, names: set[str]) -> dict[str, float]:
    """Each Prometheus sample named in ``names`` at ``url``/metrics, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).raise_for_status().text
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


@dataclass(frozen=True)
class ServerCounts:
    """What the servers counted, cumulative: requests decode finished and the prompt and
    generated tokens it counted (vLLM's own counters), and the gateway's failed requests.

    Decode continues each request from its prompt plus the first token, which prefill
    produced, and generates the rest: over ``n`` requests that reached decode, the
    prompts the gateway served hold ``decode_prompt - n`` tokens and their answers
    ``decode_generated + n``. (A request with one output token never reaches decode.)"""

    decode_finished: float
    decode_prompt: float
    decode_generated: float
    gateway_errors: float

    @classmethod
    def read(cls, stack: Stack) -> ServerCounts:
        names = {
            "vllm:request_success_total",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
        }
        decode = _sum_samples(stack.decode_url, names)
        gateway = _sum_samples(stack.url, {"flowprefill_gateway_errors_total"})
        return cls(
            decode_finished=decode["vllm:request_success_total"],
            decode_prompt=decode["vllm:prompt_tokens_total"],
            decode_generated=decode["vllm:generation_tokens_total"],
            gateway_errors=gateway["flowprefill_gateway_errors_total"],
        )

    @classmethod
    def since(cls, stack: Stack, before: ServerCounts, requests: int) -> tuple[int, int, int]:
        """(requests, prompt tokens, output tokens) served since ``before``, once decode
        has counted ``requests`` finished ones (its counters are updated just after the
        last chunk is sent, so this waits up to 30 s for them); also asserts that the
        gateway counted no failed request since."""
        deadline = time.monotonic() + 30
        while True:
            now = cls.read(stack)
            finished = round(now.decode_finished - before.decode_finished)
            if finished >= requests or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert now.gateway_errors == before.gateway_errors, (before, now)
        prompt = round(now.decode_prompt - before.decode_prompt) - finished
        output = round(now.decode_generated - before.decode_generated) + finished
        return finished, prompt, output
