"""Where prefill time goes: plain transformers vs the preemptible executor (vs vLLM).

For each model and workload (one prompt of each ``--lengths``, plus one batch of mixed
lengths ``--batch``), times in interleaved rounds (every arm once per round, the order
rotated each round) and reports medians and ratios to the plain forward:

* ``hf``: ``model(input_ids)`` under ``torch.inference_mode()`` — transformers as loaded
  (sdpa attention, logits for every position); for a batch, one call per prompt;
* ``hf-last``: the same with ``logits_to_keep=1`` (lm_head on the last position only);
* ``<granularity>/<kernels>``: ``PreemptibleExecutor.prefill`` with granularity ``none``,
  ``layer`` or ``operator`` and kernel set ``fast`` (oneDNN linears on prepacked weights)
  or ``reference`` (the model's own modules) — see ``flowprefill/prefill/executor/kernels.py``;
* ``vllm`` (with ``--vllm-python``): vLLM's offline ``LLM(dtype="float32",
  enforce_eager=True).generate(prompt_token_ids, max_tokens=1)`` in a worker subprocess run
  by that interpreter (e.g. a separate venv), kept loaded and driven over a pipe so its
  timings interleave with ours. It times itself around ``generate`` (no pipe cost).

Our arms run on one worker thread, as the engine's pool runs prefills. Wall time is the
median per arm; CPU time (``time.thread_time`` of that thread — intra-op OpenMP workers
not included — or ``time.process_time`` of the vLLM worker) is shown too, because this
machine is shared and wall time is noisy.

    python benchmarks/prefill/executor_speed.py [--models demo-llama] [--lengths 512,2048,4096]
        [--batch 256,512,1024,2048] [--repeats 5] [--threads 2]
        [--vllm-python /work/vllm-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------- vLLM worker
# Runs under the vLLM interpreter: imports nothing from this project.


def vllm_worker(model_dir: str, max_tokens_per_batch: int) -> None:
    """Load vLLM once, then time one ``generate`` per JSON line of prompts on stdin."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=max(8192, max_tokens_per_batch),
        max_num_batched_tokens=max(8192, max_tokens_per_batch),
        distributed_executor_backend="uni",
        enable_prefix_caching=False,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out = sys.stdout
    out.write(json.dumps({"ready": True, "threads": torch.get_num_threads()}) + "\n")
    out.flush()
    for line in sys.stdin:
        prompts = json.loads(line)
        requests: Any = [{"prompt_token_ids": p} for p in prompts]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        result = llm.generate(requests, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        first = [r.outputs[0].token_ids[0] for r in result]
        out.write(json.dumps({"wall": wall, "cpu": cpu, "first": first}) + "\n")
        out.flush()


class VllmClient:
    def __init__(self, python: str, model_dir: Path, max_tokens: int) -> None:
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CACHE_ROOT", "/tmp/vllmcache-executor-speed")
        self.log = Path(env["VLLM_CACHE_ROOT"]) / "worker.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [python, __file__, "--vllm-worker", str(model_dir), "--vllm-max", str(max_tokens)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
            env=env,
        )
        self.threads = int(self._read()["threads"])

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"vLLM worker exited; see {self.log}")
            if line.startswith("{"):
                return dict(json.loads(line))

    def run(self, prompts: list[list[int]]) -> tuple[float, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(prompts) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        return float(reply["wall"]), float(reply["cpu"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------------ our arms


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Arms: hf, hf-last, <granularity>/<kernels>, vllm. Medians of interleaved "
        "rounds; ratios are median wall time / median wall time of hf.",
    )
    parser.add_argument("--models", default="demo-llama", help="comma-separated model names")
    parser.add_argument("--lengths", default="512,2048,4096", help="single-prompt lengths")
    parser.add_argument(
        "--batch",
        default="256,512,1024,2048",
        help="lengths of one mixed batch run as a single prefill ('' to skip)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--granularities", default="none,layer,operator")
    parser.add_argument("--kernels", default="fast,reference", help="executor kernel sets")
    parser.add_argument("--no-hf", action="store_true", help="skip the hf and hf-last arms")
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="interpreter with vLLM installed; adds the vllm arm (subprocess)",
    )
    parser.add_argument("--cache-dir", default=None, help="model cache (default: the usual)")
    parser.add_argument("--json", default=None, help="also write results here")
    parser.add_argument("--vllm-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--vllm-max", type=int, default=8192, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_worker is not None:
        vllm_worker(args.vllm_worker, args.vllm_max)
        return
    run(args)


class Arm:
    """One timed variant; ``setup``/``teardown`` run outside the timed region."""

    def setup(self) -> None:
        pass

    def __call__(self, prompts: list[Any]) -> None:
        raise NotImplementedError

    def teardown(self) -> None:
        pass


class HfArm(Arm):
    def __init__(self, model: Any, last_only: bool) -> None:
        self.model, self.last_only = model, last_only

    def __call__(self, prompts: list[Any]) -> None:
        import torch

        with torch.inference_mode():
            for p in prompts:
                if self.last_only:
                    self.model(p[None], logits_to_keep=1)
                else:
                    self.model(p[None])


class ExecutorArm(Arm):
    def __init__(self, model: Any, granularity: str, kernels: str) -> None:
        self.model, self.granularity, self.kernels = model, granularity, kernels
        self.executor: Any = None

    def setup(self) -> None:
        from flowprefill.prefill.executor.runner import PreemptibleExecutor

        self.executor = PreemptibleExecutor(
            self.model, granularity=self.granularity, kernels=self.kernels
        )

    def __call__(self, prompts: list[Any]) -> None:
        self.executor.prefill(prompts)

    def teardown(self) -> None:
        self.executor.close()


def run(args: argparse.Namespace) -> None:
    """Time every arm on a worker thread (the engine's pool runs prefills on task threads;
    glibc serves a non-main thread's large allocations differently, see docs/executor.md)."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            run_on_this_thread(args)
        except BaseException as err:  # re-raised on the main thread
            failure.append(err)

    worker = threading.Thread(target=target, name="executor-speed")
    worker.start()
    worker.join()
    if failure:
        raise failure[0]


def run_on_this_thread(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    from rich.console import Console

    from flowprefill.models import load_model, named_model_dir

    torch.set_num_threads(args.threads)
    console = Console(width=max(120, Console().width))
    lengths = [int(x) for x in args.lengths.split(",") if x]
    batch = [int(x) for x in args.batch.split(",") if x]
    workloads: list[tuple[str, list[int]]] = [(f"1×{n}", [n]) for n in lengths]
    if batch:
        workloads.append((f"batch {'+'.join(map(str, batch))}", batch))
    results: dict[str, Any] = {
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "models": {},
    }
    console.print(
        f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start"
    )
    for name in [m for m in args.models.split(",") if m]:
        model_dir = named_model_dir(name, cache_dir=args.cache_dir)
        model = load_model(model_dir)
        gen = torch.Generator().manual_seed(0)
        vocab = int(model.config.vocab_size)
        prompts = {
            label: [torch.randint(0, vocab, (n,), generator=gen) for n in lens]
            for label, lens in workloads
        }
        arms: dict[str, Arm | None] = {}  # None: the vLLM worker
        if not args.no_hf:
            arms["hf"] = HfArm(model, last_only=False)
            arms["hf-last"] = HfArm(model, last_only=True)
        for kernels in [k for k in args.kernels.split(",") if k]:
            for granularity in [g for g in args.granularities.split(",") if g]:
                arms[f"{granularity}/{kernels}"] = ExecutorArm(model, granularity, kernels)
        vllm = None
        if args.vllm_python:
            console.print(f"starting the vLLM worker ({args.vllm_python}) ...")
            vllm = VllmClient(args.vllm_python, model_dir, max(8192, sum(batch)))
            console.print(f"vLLM worker ready, its torch threads: {vllm.threads}")
            arms["vllm"] = None
        results["models"][name] = bench_model(console, name, arms, workloads, prompts, vllm, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def bench_model(
    console: Any,
    name: str,
    arms: dict[str, Arm | None],
    workloads: list[tuple[str, list[int]]],
    prompts: dict[str, list[Any]],
    vllm: VllmClient | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    import torch
    from rich.table import Table

    wall: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    names = list(arms)
    console.print(f"{name}: arms {', '.join(names)}; {args.repeats} rounds + 1 warm-up")
    for round_index in range(args.repeats + 1):
        shift = round_index % len(names)
        for label, _ in workloads:
            ps = prompts[label]
            for arm_name in names[shift:] + names[:shift]:
                arm = arms[arm_name]
                if arm is None:
                    if vllm is None or "vllm" not in names:
                        continue
                    try:
                        w, c = vllm.run([p.tolist() for p in ps])
                    except RuntimeError as err:
                        console.print(f"[red]vLLM arm dropped: {err}[/red]")
                        names.remove("vllm")
                        continue
                else:
                    arm.setup()
                    c0, w0 = time.thread_time(), time.perf_counter()
                    arm(ps)
                    w, c = time.perf_counter() - w0, time.thread_time() - c0
                    arm.teardown()
                if round_index > 0:  # round 0 warms up every arm
                    wall.setdefault((label, arm_name), []).append(w)
                    cpu.setdefault((label, arm_name), []).append(c)
        console.print(f"  round {round_index}/{args.repeats} done", highlight=False)
    if vllm is not None:
        vllm.close()
    title = (
        f"{name}: median wall ms, ×{names[0]} (median CPU s of the timing thread / vLLM "
        f"process); {torch.get_num_threads()} torch threads"
    )
    if vllm is not None and "vllm" in names:
        title += f", vLLM {vllm.threads} threads"
    table = Table(title=title)
    table.add_column("arm")
    for label, _ in workloads:
        table.add_column(label, justify="right")
    out: dict[str, Any] = {label: {} for label, _ in workloads}
    for arm_name in names:
        row = [arm_name]
        for label, _ in workloads:
            base = statistics.median(wall[(label, names[0])])
            w = statistics.median(wall[(label, arm_name)])
            c = statistics.median(cpu[(label, arm_name)])
            row.append(f"{w * 1000:,.0f} ms {w / base:.2f}× ({c:.2f})")
            out[label][arm_name] = {
                "wall_ms_median": w * 1000,
                "cpu_s_median": c,
                "ratio_to_first": w / base,
                "wall_ms_all": [x * 1000 for x in wall[(label, arm_name)]],
            }
        table.add_row(*row)
    console.print(table)
    console.print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return out


if __name__ == "__main__":
    main()
