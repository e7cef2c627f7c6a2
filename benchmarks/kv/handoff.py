"""How long the KV hand-off takes: producer write, consumer header check, consumer read.

Part 1 (no vLLM needed) times the format on the ``demo`` shape (6 layers, 2 KV heads,
head_dim 64) with synthetic KV: ``build`` (validation + CRC-32 + copy to CPU), ``put``
(safetensors write + atomic rename into the shared directory), ``header`` (what vLLM's
scheduler does per request: metadata and shape check, no tensor data) and ``read``
(what the worker does: every layer's token range, [H,T,D] → [T,H,D] in the cache dtype).

Part 2 (``--vllm``; needs vLLM) measures decode's time to its first token in a real
``vllm.LLM`` (demo-llama, bf16, eager, prefix caching off): ``handoff`` = decode of
``prompt + [first]`` loading our KV, vs ``recompute`` = vLLM prefilling the prompt itself.

    python benchmarks/kv/handoff.py                 # part 1, 1K and 4K tokens
    python benchmarks/kv/handoff.py --vllm          # + part 2 (vLLM venv)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flowprefill.contracts.kv import HandoffRef
from flowprefill.contracts.names import DType
from flowprefill.kv import ModelFingerprint, SharedDirTransport, build_handoff
from flowprefill.kv.format import DTYPES, KVReader
from flowprefill.kv.paged import to_token_major

DEMO = ModelFingerprint(
    model_type="llama",
    num_layers=6,
    num_kv_heads=2,
    head_dim=64,
    hidden_size=512,
    vocab_size=32000,
)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def format_costs(num_tokens: int, dtype: str, root: Path, repeats: int) -> dict[str, Any]:
    fp, torch_dtype = DEMO, DTYPES[DType.parse(dtype)]
    shape = (fp.num_kv_heads, num_tokens, fp.head_dim)
    layers = [
        (torch.randn(shape).to(torch_dtype), torch.randn(shape).to(torch_dtype))
        for _ in range(fp.num_layers)
    ]
    ids = list(range(3, 3 + num_tokens))
    transport = SharedDirTransport(root)
    handoff = build_handoff(layers, ids, fp)
    transport.put("bench", handoff)

    def read() -> None:
        with transport.open("bench") as reader:
            for i in range(fp.num_layers):
                k, v = reader.layer(i, 0, num_tokens)
                to_token_major(k, (0, fp.num_kv_heads), torch.bfloat16, torch.device("cpu"))
                to_token_major(v, (0, fp.num_kv_heads), torch.bfloat16, torch.device("cpu"))

    return {
        "tokens": num_tokens,
        "dtype": dtype,
        "MiB": transport.path("bench").stat().st_size / 2**20,
        "build_ms": _median_ms(lambda: build_handoff(layers, ids, fp), repeats),
        "put_ms": _median_ms(lambda: transport.put("bench", handoff), repeats),
        "header_ms": _median_ms(lambda: transport.header("bench"), repeats),
        "read_ms": _median_ms(read, repeats),
        # What the http transport adds to each download: every byte against the digest
        # and CRC-32 (the bytes crossed the network from a peer that may be broken).
        "verify_ms": _median_ms(lambda: verify(transport.path("bench")), repeats),
    }


def verify(path: Path) -> None:
    with KVReader(path) as reader:
        reader.verify()


def vllm_ttft(lengths: list[int], work: Path, repeats: int) -> list[dict[str, Any]]:
    """Decode time to first token with our KV vs recomputing the prompt (real vLLM)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from flowprefill.contracts.kv import kv_transfer_config
    from flowprefill.kv import reference_prefill
    from flowprefill.models import build_named, save_model_dir

    model = build_named("demo-llama", dtype=torch.bfloat16)
    model_dir = save_model_dir(model, work / "demo-llama")
    store = SharedDirTransport(work / "store")
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(3, 32000, (n,), generator=gen).tolist() for n in lengths}
    firsts = {}
    for n, ids in prompts.items():
        result = reference_prefill(model, ids)
        store.put(f"n{n}", result.handoff)
        firsts[n] = result.first_token_id
    del model
    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=8192,
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
        kv_transfer_config=kv_transfer_config(str(store.root)),
        seed=0,
    )

    def ttft(ids: list[int], handoff: str | None) -> float:
        extra = None if handoff is None else {"kv_transfer_params": HandoffRef(handoff).to_params()}
        params = SamplingParams(temperature=0.0, max_tokens=1, extra_args=extra)
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return (time.perf_counter() - t0) * 1e3

    # The first requests through a fresh engine (and through a connector) pay one-time
    # costs of several hundred ms; keep them out of the per-length figures.
    warm = prompts[min(prompts)]
    warm_ms = [ttft(warm[:64], None), ttft([*warm, firsts[min(prompts)]], f"n{min(prompts)}")]
    rows = []
    for n, ids in prompts.items():
        first_ms = ttft([*ids, firsts[n]], f"n{n}")
        ttft(ids, None)  # warm the recompute path for this length
        rows.append(
            {
                "tokens": n,
                "handoff_first_request_ms": first_ms,
                "engine_warmup_ms": warm_ms,
                "handoff_ms": statistics.median(
                    ttft([*ids, firsts[n]], f"n{n}") for _ in range(repeats)
                ),
                "recompute_ms": statistics.median(ttft(ids, None) for _ in range(repeats)),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vllm", action="store_true", help="also time decode in real vLLM")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    lengths = [int(x) for x in args.lengths.split(",")]
    out: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory(prefix="kv-bench-") as tmp:
        rows = [
            format_costs(n, d, Path(tmp) / "fmt", args.repeats)
            for n in lengths
            for d in ("bfloat16", "float32")
        ]
        out["format"] = rows
        print(
            f"{'tokens':>7} {'dtype':>9} {'MiB':>6} {'build':>8} {'put':>8} {'header':>8} "
            f"{'read':>8} {'verify':>8}   (ms, median of {args.repeats})"
        )
        for r in rows:
            print(
                f"{r['tokens']:>7} {r['dtype']:>9} {r['MiB']:>6.1f} {r['build_ms']:>8.1f} "
                f"{r['put_ms']:>8.1f} {r['header_ms']:>8.2f} {r['read_ms']:>8.1f} "
                f"{r['verify_ms']:>8.1f}"
            )
        if args.vllm:
            out["vllm"] = vllm_ttft(lengths, Path(tmp), args.repeats)
            print(f"\nengine warm-up (recompute, hand-off): {out['vllm'][0]['engine_warmup_ms']}")
            print(
                f"{'tokens':>7} {'first req':>10} {'handoff':>9} {'recompute':>10}   "
                "(ms to decode's first token, demo-llama bf16)"
            )
            for r in out["vllm"]:
                print(
                    f"{r['tokens']:>7} {r['handoff_first_request_ms']:>10.1f} "
                    f"{r['handoff_ms']:>9.1f} {r['recompute_ms']:>10.1f}"
                )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
