"""The colocated pod's in-pod launcher (``flowprefill_operator.colocated``) with real
processes: the start order, the exit codes, SIGTERM, bad launch specs, the rendered spec
round trip and ``cap-memory``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from flowprefill_operator.colocated import Child, LaunchSpec

from tests.operator.crdcheck import ROOT
from tests.operator.harness import free_port, wait_for
from tests.operator.test_operator_colocated import colocated, launch_of, parts

CHILD = Path(__file__).with_name("colocated_child.py")


def child(name: str, port: int, logdir: Path, *extra: str, env: dict[str, str] | None = None,
          ready: str = "/ready") -> Child:  # fmt: skip
    argv = [sys.executable, str(CHILD), str(port), str(logdir), name, *extra]
    return Child(name, argv, port, ready, "/health", env=env or {})


def start_launcher(spec: LaunchSpec) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "operator"), "SHARED": "both"}
    return subprocess.Popen(
        [sys.executable, "-m", "flowprefill_operator.colocated", "run", spec.to_json()],
        env=env,
        stderr=subprocess.PIPE,
    )


def probe(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_launcher_starts_decode_after_prefill_is_ready_and_answers_for_both(
    tmp_path: Path,
) -> None:
    p_port, d_port, h_port = free_port(), free_port(), free_port()
    spec = LaunchSpec(
        prefill=child("prefill", p_port, tmp_path, "--ready-after", "1.5", "--record-env",
                      "SHARED", "VLLM_NIXL_SIDE_CHANNEL_PORT"),
        decode=child("decode", d_port, tmp_path, "--record-env", "SHARED",
                     "VLLM_NIXL_SIDE_CHANNEL_PORT", env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5700"}),
        health_port=h_port,
    )  # fmt: skip
    proc = start_launcher(spec)
    try:
        wait_for(lambda: (tmp_path / "prefill.started").exists(), what="prefill started")
        assert probe(h_port, "/health") == 503  # decode not started yet
        assert probe(h_port, "/ready") == 503
        assert not (tmp_path / "decode.started").exists()
        wait_for(lambda: probe(h_port, "/ready") == 200, what="both ready")
        assert probe(h_port, "/health") == 200
        assert probe(h_port, "/other") == 404
        ready_at = float((tmp_path / "prefill.ready").read_text())
        assert float((tmp_path / "decode.started").read_text()) >= ready_at
        # Each process gets the container's env plus its own, not the other's.
        assert json.loads((tmp_path / "prefill.env").read_text()) == {
            "SHARED": "both", "VLLM_NIXL_SIDE_CHANNEL_PORT": None}  # fmt: skip
        assert json.loads((tmp_path / "decode.env").read_text()) == {
            "SHARED": "both", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5700"}  # fmt: skip
        # The pod goes away: SIGTERM reaches both, each drains, the launcher exits 0.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert (tmp_path / "prefill.sigterm").exists() and (tmp_path / "decode.sigterm").exists()
    finally:
        stop(proc)


def test_launcher_exits_with_the_code_of_the_process_that_died(tmp_path: Path) -> None:
    p_port, d_port, h_port = free_port(), free_port(), free_port()
    spec = LaunchSpec(
        prefill=child("prefill", p_port, tmp_path),
        decode=child("decode", d_port, tmp_path, "--exit-after", "1", "--exit-code", "3"),
        health_port=h_port,
        stop_timeout_s=10,
    )
    proc = start_launcher(spec)
    try:
        assert proc.wait(timeout=30) == 3
        assert (tmp_path / "prefill.sigterm").exists()  # the survivor was stopped
        assert proc.stderr is not None
        assert b"decode exited with 3" in proc.stderr.read()
    finally:
        stop(proc)


def test_launcher_exits_when_prefill_dies_before_decode_starts(tmp_path: Path) -> None:
    p_port, d_port, h_port = free_port(), free_port(), free_port()
    spec = LaunchSpec(
        prefill=child("prefill", p_port, tmp_path, "--ready-after", "60", "--exit-after",
                      "0.5", "--exit-code", "0"),
        decode=child("decode", d_port, tmp_path),
        health_port=h_port,
    )  # fmt: skip
    proc = start_launcher(spec)
    try:
        assert proc.wait(timeout=30) == 1  # an exit of 0 is unexpected too
        assert not (tmp_path / "decode.started").exists()
    finally:
        stop(proc)


def test_sigterm_before_decode_starts_stops_prefill_and_never_starts_decode(
    tmp_path: Path,
) -> None:
    p_port, d_port, h_port = free_port(), free_port(), free_port()
    spec = LaunchSpec(
        prefill=child("prefill", p_port, tmp_path, "--ready-after", "60"),
        decode=child("decode", d_port, tmp_path),
        health_port=h_port,
    )
    proc = start_launcher(spec)
    try:
        wait_for(lambda: (tmp_path / "prefill.started").exists(), what="prefill started")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert (tmp_path / "prefill.sigterm").exists()
        time.sleep(1)  # a poll round after the exit: nothing starts decode late
        assert not (tmp_path / "decode.started").exists()
    finally:
        stop(proc)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[", "not JSON"),
        ("[]", "expected a JSON object"),
        ('{"prefill": {}, "decode": {}, "extra": 1}', "unknown keys ['extra']"),
        ('{"decode": {}}', "prefill: expected an object"),
        ('{"prefill": {"argv": []}, "decode": {}}', "prefill.argv"),
        ('{"prefill": {"argv": ["x"], "port": 0}, "decode": {}}', "prefill.port"),
        ('{"prefill": {"argv": ["x"], "port": 1, "ready_path": "r", "health_path": "/h"},'
         ' "decode": {}}', "prefill.ready_path"),
        ('{"prefill": {"argv": ["x"], "port": 1, "ready_path": "/r", "health_path": "/h",'
         ' "memory_fraction": 1.5}, "decode": {}}', "prefill.memory_fraction"),
        # The probe port comes from the operator (contracts.deployment); no default here.
        ('{"prefill": {"argv": ["x"], "port": 1, "ready_path": "/r", "health_path": "/h"},'
         ' "decode": {"argv": ["y"], "port": 2, "ready_path": "/r", "health_path": "/h"}}',
         "health_port: expected a TCP port"),
    ],
)  # fmt: skip
def test_bad_launch_specs_name_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        LaunchSpec.parse(text)


def test_rendered_launch_spec_round_trips() -> None:
    _, dep, _ = parts(colocated())
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    launch = launch_of(container)
    assert LaunchSpec.parse(launch.to_json()) == launch
    cap = launch.prefill.command()
    assert cap[1:5] == ["-m", "flowprefill_operator.colocated", "cap-memory", "0.4"]
    assert cap[5] == "--" and cap[6:] == launch.prefill.argv


def test_cap_memory_refuses_without_a_gpu_and_bad_fractions() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "operator"), "CUDA_VISIBLE_DEVICES": ""}
    base = [sys.executable, "-m", "flowprefill_operator.colocated", "cap-memory"]
    out = subprocess.run([*base, "0.4", "--", "flowprefill", "--help"], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and "no CUDA device" in out.stderr
    out = subprocess.run([*base, "1.5", "--", "flowprefill"], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "fraction must be in (0, 1)" in out.stderr
