"""End-to-end check of the KV hand-off: HF prefill → hand-off files → vLLM decode.

Runs in an environment with vLLM (see docs/kv.md). One process, one ``vllm.LLM`` with the
FlowPrefill connector as consumer, prefix caching off so every cached token is one our
connector loaded. For each prompt length it compares greedy tokens of

* ``alone``:  vLLM generating from the prompt by itself (no hand-off),
* ``first``:  decode of ``prompt + [our first token]`` with the hand-off (the gateway's
  shape): our first token + decode's tokens must equal ``alone``,
* ``bare``:   decode of the bare prompt with the hand-off: must equal ``alone``,
* ``poison``: a hand-off whose KV values are scaled (ids and checksum valid): its output
  must *differ*, proving decode used our KV instead of recomputing the prompt,
* ``wrong``:  a hand-off for another prompt: rejected, recomputed, output equals ``alone``.

Prints one JSON object (also to ``--json``); exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    # ids 0..2 are special tokens (eos among them): keep prompts to ordinary ids
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def produce(model_dir: Path, store: Path, prompts: list[list[int]]) -> dict[str, Any]:
    """The prefill side: reference HF prefill in float32, hand-offs into ``store``."""
    import torch
    from transformers import AutoModelForCausalLM

    from flowprefill.kv import SharedDirTransport, build_handoff, reference_prefill

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    transport = SharedDirTransport(store)
    firsts: dict[str, int] = {}
    timings: dict[str, float] = {}
    for i, ids in enumerate(prompts):
        t0 = time.perf_counter()
        result = reference_prefill(model, ids, request_id=f"p{i}")
        t1 = time.perf_counter()
        transport.put(f"p{i}", result.handoff)
        timings[f"p{i}_prefill_ms"] = (t1 - t0) * 1e3
        timings[f"p{i}_write_ms"] = (time.perf_counter() - t1) * 1e3
        firsts[f"p{i}"] = result.first_token_id
        # Same tokens and checksum rules, corrupted values: decode must notice nothing
        # in validation but produce different tokens if (and only if) it uses the KV.
        poisoned = [(k * 3.0 + 1.0, v * -2.0) for k, v in result.handoff.layers]
        fp = result.handoff.header.fingerprint
        transport.put(f"p{i}-poison", build_handoff(poisoned, ids, fp))
    # KV of prompt 0 offered for prompt 1: must be rejected by the token-id check.
    return {"first": firsts, "timings": timings}


def decode(
    model_dir: Path,
    store: Path,
    prompts: list[list[int]],
    firsts: dict[str, int],
    max_tokens: int,
    prefix_caching: bool = False,
) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from flowprefill.contracts.kv import HandoffRef, kv_transfer_config

    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        enable_prefix_caching=prefix_caching,
        distributed_executor_backend="uni",
        # Each hand-off is loaded by several cases below: keep it after a request.
        kv_transfer_config=kv_transfer_config(str(store), delete_after_load=False),
        seed=0,
    )
    startup_s = time.perf_counter() - t0
    block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)

    def run(ids: list[int], n: int, handoff: str | None) -> dict[str, Any]:
        extra = None if handoff is None else {"kv_transfer_params": HandoffRef(handoff).to_params()}
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, extra_args=extra)
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        return {
            "tokens": list(out.outputs[0].token_ids),
            "num_cached_tokens": out.num_cached_tokens,
            "kv_transfer_params": out.kv_transfer_params,
            "ms": (time.perf_counter() - t) * 1e3,
        }

    if prefix_caching:
        return {
            "startup_s": startup_s,
            "cases": _prefix_cases(run, prompts, firsts, max_tokens, block_size),
        }
    cases: list[dict[str, Any]] = []
    for i, ids in enumerate(prompts):
        name = f"p{i}"
        alone = run(ids, max_tokens, None)
        first = run([*ids, firsts[name]], max_tokens - 1, name)
        bare = run(ids, max_tokens, name)
        poison = run([*ids, firsts[name]], max_tokens - 1, f"{name}-poison")
        wrong = run(prompts[(i + 1) % len(prompts)], max_tokens, name) if len(prompts) > 1 else None
        wrong_alone = run(prompts[(i + 1) % len(prompts)], max_tokens, None) if wrong else None
        checks = {
            "first_token_matches": alone["tokens"][0] == firsts[name],
            "first_matches": [firsts[name], *first["tokens"]] == alone["tokens"],
            "first_all_prompt_cached": first["num_cached_tokens"] == len(ids),
            "bare_matches": bare["tokens"] == alone["tokens"],
            "bare_cached": bare["num_cached_tokens"] == len(ids) - 1,
            "alone_uncached": alone["num_cached_tokens"] == 0,
            "poison_differs": [firsts[name], *poison["tokens"]] != alone["tokens"],
        }
        if wrong is not None and wrong_alone is not None:
            status = (wrong["kv_transfer_params"] or {}).get("flowprefill", {}).get("status")
            checks["wrong_recomputed"] = status == "recomputed" and wrong["num_cached_tokens"] == 0
            checks["wrong_matches_alone"] = wrong["tokens"] == wrong_alone["tokens"]
        cases.append(
            {
                "name": name,
                "prompt_len": len(ids),
                "checks": checks,
                "alone": alone,
                "first": first,
                "bare": bare,
                "poison": poison,
                "wrong": wrong,
            }
        )
    return {"startup_s": startup_s, "cases": cases}


def _prefix_cases(
    run: Any, prompts: list[list[int]], firsts: dict[str, int], max_tokens: int, block_size: int
) -> list[dict[str, Any]]:
    """With vLLM's prefix cache on: ``alone`` leaves the prompt's full blocks cached, so the
    hand-off request gets a local hit and the connector must load only the tail after it."""
    cases = []
    for i, ids in enumerate(prompts):
        name = f"p{i}"
        alone = run(ids, max_tokens, None)
        first = run([*ids, firsts[name]], max_tokens - 1, name)
        local = len(ids) // block_size * block_size
        loaded = (first["kv_transfer_params"] or {}).get("flowprefill", {}).get("loaded_tokens")
        checks = {
            "first_token_matches": alone["tokens"][0] == firsts[name],
            "first_matches": [firsts[name], *first["tokens"]] == alone["tokens"],
            "first_all_prompt_cached": first["num_cached_tokens"] == len(ids),
            "loaded_only_tail": loaded == len(ids) - local,
        }
        cases.append(
            {
                "name": name,
                "prompt_len": len(ids),
                "checks": checks,
                "alone": alone,
                "first": first,
                "local_hit_tokens": local,
            }
        )
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--store", type=Path, required=True, help="hand-off directory")
    parser.add_argument("--lengths", default="5,130,300", help="prompt lengths, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix-caching", action="store_true", help="vLLM prefix cache on")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    config = json.loads((args.model_dir / "config.json").read_text())
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = _prompts(lengths, int(config["vocab_size"]), args.seed)
    produced = produce(args.model_dir, args.store, prompts)
    result = decode(
        args.model_dir,
        args.store,
        prompts,
        produced["first"],
        args.max_tokens,
        args.prefix_caching,
    )
    result["producer_timings_ms"] = produced["timings"]
    result["ok"] = all(all(c["checks"].values()) for c in result["cases"])
    text = json.dumps(result, indent=1, default=str)
    if args.json is not None:
        args.json.write_text(text)
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
