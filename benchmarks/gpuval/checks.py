"""Section 1: CUDA-only correctness of the executor's device layer (flowprefill/prefill/executor/
device.py) on the real model, and the device tests run by pytest.

On CPU the stream checks are reported as skipped (synchronous ops, no streams); the
device-independent ones (checkpoint count, park, bit-identical resume) still run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpuval.common import (
    ROOT,
    Context,
    Probe,
    TaskThread,
    executor_for,
    new_table,
    plain_forward,
    same_result,
)
from benchmarks.gpuval.nixl_pages import nixl_page_checks
from flowprefill.prefill.executor.preemption import TaskControl

DEVICE_TESTS = ("tests/prefill/executor/test_device.py",)
NO_STREAMS = "CPU: synchronous ops, no streams (tested with a fake async backend in test_device.py)"
COLOURS = {"ok": "green", "failed": "red", "skipped": "yellow", "info": "cyan"}


def start_device_tests(out: Path) -> subprocess.Popen[str]:
    """Run the device tests in a subprocess; started before the model is built, so its
    CPU work overlaps the build (it is collected before anything is timed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    with (out / "pytest_device.log").open("w") as log:
        return subprocess.Popen(
            [*command, *DEVICE_TESTS],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )


def collect_device_tests(ctx: Context, timeout_s: float) -> dict[str, Any]:
    proc = ctx.pytest_proc
    assert proc is not None
    try:
        rc = proc.wait(timeout=max(timeout_s, 30.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return {"status": "failed", "detail": f"pytest did not finish in {timeout_s:.0f} s"}
    lines = [ln for ln in (ctx.out / "pytest_device.log").read_text().splitlines() if ln.strip()]
    return {
        "status": "ok" if rc == 0 else "failed",
        "detail": lines[-1] if lines else "",
        "returncode": rc,
        "skipped": [line for line in lines if line.startswith("SKIPPED")],
        "log": "pytest_device.log",
    }


class Checks:
    """The list of results, each ``{"name", "status", "detail"}``."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.items: list[dict[str, Any]] = []

    def add(self, name: str, ok: bool | None, detail: str = "", cuda_only: bool = False) -> None:
        """``ok`` None records information, not a pass/fail."""
        if cuda_only and not self.cuda:
            self.items.append({"name": name, "status": "skipped", "detail": NO_STREAMS})
            return
        status = "info" if ok is None else ("ok" if ok else "failed")
        self.items.append({"name": name, "status": status, "detail": detail})


def section_checks(ctx: Context, rec: dict[str, Any], deadline: float) -> None:
    checks = Checks(ctx.cuda)
    rec["checks"] = checks.items
    test_name = "pytest " + " ".join(DEVICE_TESTS)
    if ctx.pytest_proc is not None:
        result = collect_device_tests(ctx, deadline - time.perf_counter())
        checks.items.append({"name": test_name, **result})
    else:
        why = "--no-pytest" if ctx.cuda else "no CUDA device (the CPU test suite runs them)"
        checks.items.append({"name": test_name, "status": "skipped", "detail": why})
    n = min(ctx.plan.check_tokens, int(ctx.config.max_position_embeddings))
    prompt = ctx.prompt(n, seed=1)
    if ctx.cuda:
        attention_kernel(ctx, checks)
    park_at = every_check(ctx, checks, prompt)
    for mode in ("run_ahead", "on_preempt"):
        drained_at_park(ctx, checks, prompt, park_at, mode)
    if ctx.cuda:
        nixl_page_checks(ctx.device, ctx.dtype, checks.add)
    else:
        checks.add("NIXL KV pages in device memory", None, "", cuda_only=True)
    if any(item["status"] == "failed" for item in checks.items):
        rec["status"] = "failed"
    title = "CUDA correctness checks" + ("" if ctx.cuda else " (CPU: stream checks skipped)")
    table = new_table(title, ("check", "status", "detail"), left=3)
    for item in checks.items:
        status = item["status"]
        table.add_row(item["name"], f"[{COLOURS[status]}]{status}[/]", str(item["detail"])[:100])
    ctx.console.print(table)


def attention_kernel(ctx: Context, checks: Checks) -> None:
    """The model's attention (causal, GQA through ``enable_gqa``, as transformers' sdpa
    integration calls it without a mask) must run on a fused kernel: the math fallback
    would materialise heads × n² scores (64 GiB at 32K tokens for Llama-3-8B)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    config = ctx.config
    head_dim = config.hidden_size // config.num_attention_heads
    shape = (1, config.num_attention_heads, 512, head_dim)
    q = torch.randn(shape, device=ctx.device, dtype=ctx.dtype)
    kv = torch.randn(
        (1, config.num_key_value_heads, 512, head_dim), device=ctx.device, dtype=ctx.dtype
    )
    found = "none but math"
    for name, backends in (
        ("flash", [SDPBackend.FLASH_ATTENTION]),
        ("cuDNN / efficient", [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]),
    ):
        try:
            with sdpa_kernel(backends):
                torch.nn.functional.scaled_dot_product_attention(
                    q, kv, kv, is_causal=True, enable_gqa=True
                )
        except RuntimeError:
            continue
        found = name
        break
    checks.add(
        "causal GQA attention runs on a fused sdpa kernel (no n² scores)",
        found != "none but math",
        f"{found} ({ctx.dtype}, {config.num_attention_heads}/{config.num_key_value_heads} heads)",
    )


def every_check(ctx: Context, checks: Checks, prompt: torch.Tensor) -> int:
    """The default sync mode: reference run, a task parked mid-prefill while another runs
    beside it, then resumed. Returns the checkpoint the task was parked at."""
    default_stream = int(torch.cuda.default_stream(ctx.device).cuda_stream) if ctx.cuda else 0
    plain = plain_forward(ctx, prompt)  # before any hooks are installed
    with executor_for(ctx, "operator") as ex:
        expected = ex.expected_checkpoints([len(prompt)])
        reference = Probe("reference", ctx.cuda)
        ref = ex.run([prompt], reference)[0]
        checks.add(
            "checkpoints passed = expected_checkpoints",
            reference.num_checkpoints == expected,
            f"{reference.num_checkpoints} of {expected} ({len(prompt)} tokens)",
        )
        # nan_to_num: random weights may overflow; the same overflow in both is agreement.
        expected_logits, got_logits = torch.nan_to_num(plain), torch.nan_to_num(ref.logits)
        diff = float((expected_logits - got_logits).abs().max())
        scale = float(expected_logits.abs().max()) or 1.0
        tolerance = 1e-4 if ctx.dtype == torch.float32 else 3e-2
        same_token = int(plain.argmax()) == ref.first_token_id
        finite = bool(torch.isfinite(plain).all())
        checks.add(
            "executor logits match the plain forward",
            diff <= tolerance * scale,
            f"max |Δ| {diff:.3g} of max |logit| {scale:.3g}; first token "
            + ("equal" if same_token else "differs")
            + ("" if finite else "; logits not finite (random weights)"),
        )
        ids = reference.stream_ids
        checks.add(
            "a task runs on one stream of its own, not the default stream",
            len(ids) == 1 and default_stream not in ids,
            f"{len(ids)} stream(s)",
            cuda_only=True,
        )
        idle = reference.idle_at_check
        checks.add(
            "every_check: the task's stream is idle at every checkpoint",
            bool(idle) and all(idle),
            f"{sum(idle)} of {len(idle)}",
            cuda_only=True,
        )
        park_at = max(1, expected // 2)
        a = Probe("A", ctx.cuda, park_at=park_at)
        task_a = TaskThread(ex, [prompt], a).start()
        parked = a.wait_parked_or_done(timeout_s=300.0) and a.parked
        checks.add(
            "a task parks at the checkpoint it stopped at",
            parked and a.num_checkpoints == park_at,
            f"checkpoint {a.num_checkpoints} of {expected}",
        )
        checks.add(
            "every_check: a parked task leaves no queued kernels (stream idle after ACK)",
            a.stream_idle(),
            cuda_only=True,
        )
        b = Probe("B", ctx.cuda)
        equal, diff = same_result(TaskThread(ex, [prompt], b).start().join()[0], ref)
        checks.add("a task beside a parked one equals the reference", equal, f"max |Δ| {diff:.3g}")
        checks.add("the parked task did not move while another ran", a.num_checkpoints == park_at)
        checks.add("two tasks, two streams", a.stream_ids.isdisjoint(b.stream_ids), cuda_only=True)
        a.resume()
        equal, diff = same_result(task_a.join()[0], ref)
        checks.add("preempted + resumed prefill is bit-identical", equal, f"max |Δ| {diff:.3g}")
    return park_at


def drained_at_park(
    ctx: Context, checks: Checks, prompt: torch.Tensor, park_at: int, mode: str
) -> None:
    """``sync`` modes that let the host run ahead (``on_preempt``: as far as it likes;
    ``run_ahead``: one operator): work can still be queued when the task parks, and the
    drain before the ACK must empty the stream."""
    names = (
        f"{mode}: work was still queued when the task reached its park",
        f"{mode}: a parked task leaves no queued kernels (drained before the ACK)",
        f"{mode}: preempted + resumed prefill is bit-identical",
    )
    if not ctx.cuda:
        for name in names:
            checks.add(name, None, cuda_only=True)
        return
    with executor_for(ctx, f"operator/{mode}") as ex:
        ref = ex.run([prompt], TaskControl("reference"))[0]
        probe = Probe("C", cuda=True, park_at=park_at)
        task = TaskThread(ex, [prompt], probe).start()
        probe.wait_parked_or_done(timeout_s=300.0)
        queued = sum(not idle for idle in probe.idle_at_check)
        checks.add(
            names[0],
            None,
            f"{'yes' if probe.queued_at_park else 'no'}; queued at {queued} of "
            f"{len(probe.idle_at_check)} checkpoints (host ahead of the GPU)",
        )
        checks.add(names[1], probe.parked and probe.stream_idle())
        probe.resume()
        equal, diff = same_result(task.join()[0], ref)
        checks.add(names[2], equal, f"max |Δ| {diff:.3g}")
