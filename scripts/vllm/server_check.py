"""The decode path as the gateway uses it: vLLM's OpenAI server with the FlowPrefill connector.

Produces hand-offs with a reference HF prefill (float32), starts
``python -m vllm.entrypoints.openai.api_server`` as a consumer, and sends
``POST /v1/completions`` with ``prompt = prompt_ids + [first_token]`` and
``kv_transfer_params`` — non-streaming and streaming — comparing with the same server
generating from the bare prompt alone. The server runs with its defaults (prefix caching
on), as the gateway's decode pool would. Prints one JSON object; exit 0 when all checks pass.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from disagg_check import _prompts, produce


def _post(url: str, body: dict[str, Any], stream: bool = False) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        if not stream:
            return json.loads(resp.read())
        events = []
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
        return events


def decode_body(
    model: str, ids: list[int], first: int, max_tokens: int, handoff_id: str | None, stream: bool
) -> dict[str, Any]:
    """The request the gateway sends to decode (see docs/kv.md)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": [*ids, first] if handoff_id else ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if handoff_id:
        body["kv_transfer_params"] = {
            "flowprefill": {"version": 1, "handoff_id": handoff_id, "num_tokens": len(ids)}
        }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout_s: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2):
                return time.perf_counter() - t0
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"vLLM server not healthy after {timeout_s} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--lengths", default="5,300")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--port", type=int, default=18765)
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's (CPU: 128)")
    parser.add_argument("--log", type=Path, default=None, help="server log file")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    config = json.loads((args.model_dir / "config.json").read_text())
    prompts = _prompts([int(x) for x in args.lengths.split(",")], int(config["vocab_size"]), 1)
    produced = produce(args.model_dir, args.store, prompts)
    kv_config = {
        "kv_connector": "FlowPrefillConnector",
        "kv_connector_module_path": "flowprefill.kv.connector",
        "kv_role": "kv_consumer",
        # Each hand-off is loaded more than once (streamed and not): keep it.
        "kv_connector_extra_config": {
            "shared_storage_path": str(args.store),
            "delete_after_load": False,
        },
    }
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(args.model_dir),
        "--served-model-name",
        "decode",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--enable-prompt-tokens-details",
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--kv-transfer-config",
        json.dumps(kv_config),
    ]
    log = open(args.log or os.devnull, "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{args.port}"
    result: dict[str, Any] = {"command": cmd, "cases": []}
    try:
        result["startup_s"] = wait_healthy(base, proc, 300)
        url = f"{base}/v1/completions"
        for i, ids in enumerate(prompts):
            name, first = f"p{i}", produced["first"][f"p{i}"]
            alone = _post(url, decode_body("decode", ids, first, args.max_tokens, None, False))
            t0 = time.perf_counter()
            disagg = _post(url, decode_body("decode", ids, first, args.max_tokens - 1, name, False))
            disagg_ms = (time.perf_counter() - t0) * 1e3
            events = _post(
                url, decode_body("decode", ids, first, args.max_tokens - 1, name, True), stream=True
            )
            streamed = [
                t for e in events for c in e.get("choices", []) for t in c.get("token_ids") or []
            ]
            usage: dict[str, Any] = next((e["usage"] for e in events if e.get("usage")), {})
            want = alone["choices"][0]["token_ids"]
            tail = len(ids) - len(ids) // args.block_size * args.block_size
            checks = {
                "nonstream_matches": [first, *disagg["choices"][0]["token_ids"]] == want,
                "stream_matches": [first, *streamed] == want,
                "cached_tokens": disagg["usage"]["prompt_tokens_details"]["cached_tokens"]
                == len(ids),
                "stream_cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens")
                == len(ids),
                # Prefix caching is on (the server default): ``alone`` left the prompt's
                # full blocks cached, so the connector loads only the tokens after them.
                "loaded_tail": (disagg.get("kv_transfer_params") or {}).get("flowprefill")
                == {"handoff_id": name, "loaded_tokens": tail, "status": "loaded"},
            }
            result["cases"].append(
                {
                    "name": name,
                    "prompt_len": len(ids),
                    "checks": checks,
                    "alone": want,
                    "disagg": disagg["choices"][0]["token_ids"],
                    "disagg_usage": disagg["usage"],
                    "disagg_ms": disagg_ms,
                    "kv_transfer_params": disagg.get("kv_transfer_params"),
                }
            )
        result["ok"] = all(all(c["checks"].values()) for c in result["cases"])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    text = json.dumps(result, indent=1)
    if args.json is not None:
        args.json.write_text(text)
    print(text)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
