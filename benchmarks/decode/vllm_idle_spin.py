"""vLLM decode speed under FlowPrefill's cap on vLLM's idle busy-wait.

Starts one vLLM decode server per setting (the built-in demo Llama, our connector loaded,
``flowprefill up``'s decode command and environment), then times ``--repeats`` greedy
completions of ``--tokens`` tokens each, one at a time::

    python benchmarks/decode/vllm_idle_spin.py [--caps default,0,0.005] [--tokens 32] [--repeats 6]

``default`` leaves vLLM's own 1 s busy-wait; a number caps it (seconds,
``$FLOWPREFILL_VLLM_IDLE_SPIN_S``; see flowprefill/kv/vllm_idle.py). Needs vLLM.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

# Run as a script: the repository root goes on the path so that ``benchmarks`` imports as a
# package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.stack.common import free_port


def serve_and_time(model: Path, run_dir: Path, cap: str, tokens: int, repeats: int) -> list[float]:
    from flowprefill.contracts.deployment import VLLM_IDLE_SPIN_ENV as IDLE_SPIN_ENV
    from flowprefill.stack.decode import decode_env, decode_spec

    port = free_port()
    env = {**os.environ, **decode_env(run_dir), IDLE_SPIN_ENV: "" if cap == "default" else cap}
    log = run_dir / f"vllm-{cap}.log"
    cmd = decode_spec(model, port, run_dir / "kv", max_model_len=2048).argv
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vLLM exited during start-up; see {log}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"vLLM did not start; see {log}")
            time.sleep(1)
        times = []
        for i in range(repeats):
            body = {
                "model": str(model),
                "prompt": [5 + i, 6, 7, 8],
                "max_tokens": tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
            t0 = time.perf_counter()
            httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()
            times.append(time.perf_counter() - t0)
        return times
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--caps", default="default,0,0.005")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    from flowprefill.models import named_model_dir

    console = Console()
    table = Table(title=f"vLLM decode, {args.tokens}-token completions, one at a time")
    for col in ("busy-wait cap", "median ms", "max ms", "ms per token", "vs default"):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory(prefix="idle-spin-") as tmp:
        run_dir = Path(tmp)
        model = named_model_dir("demo-llama")  # the usual cache ($FLOWPREFILL_MODEL_CACHE)
        medians: dict[str, float] = {}
        for cap in args.caps.split(","):
            with console.status(f"cap {cap}: starting vLLM and decoding"):
                times = serve_and_time(model, run_dir, cap, args.tokens, args.repeats)
            medians[cap] = statistics.median(times)
            base = medians.get("default")
            table.add_row(
                cap,
                f"{medians[cap] * 1e3:.0f}",
                f"{max(times) * 1e3:.0f}",
                f"{medians[cap] * 1e3 / args.tokens:.1f}",
                "-" if base is None else f"{medians[cap] / base:.2f}x",
            )
    console.print(table)


if __name__ == "__main__":
    main()
