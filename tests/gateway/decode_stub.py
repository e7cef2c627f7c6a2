"""A stand-in vLLM decode server, run as its own process so a test can SIGKILL it.

``python -m tests.gateway.decode_stub PORT RECORD_DIR --chunks N --hold S``: answers
``/health``, and streams each ``/v1/completions`` as vLLM's OpenAI server does (SSE over
chunked encoding, so a death mid-stream is a broken body, not an ending): ``N`` chunks,
then nothing for ``S`` seconds, then a last chunk with ``finish_reason`` and ``[DONE]``.

Each request is recorded, before anything is sent, as ``RECORD_DIR/<port>.json``: the
hand-off id its ``kv_transfer_params`` name. The stub never touches a hand-off (it has no
KV connector): whatever deletes one is the gateway's doing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


def create_stub(port: int, record_dir: Path, chunks: int, hold_s: float) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        handoff = (body.get("kv_transfer_params") or {}).get("flowprefill", {})
        record = {"handoff_id": handoff.get("handoff_id"), "max_tokens": body["max_tokens"]}
        tmp = record_dir / f".{port}.json"
        tmp.write_text(json.dumps(record))
        tmp.rename(record_dir / f"{port}.json")  # atomic: the test never reads half of it

        async def events() -> AsyncIterator[str]:
            for _ in range(chunks):
                yield _event({"choices": [{"index": 0, "text": " x", "finish_reason": None}]})
            await asyncio.sleep(hold_s)
            yield _event({"choices": [{"index": 0, "text": " y", "finish_reason": "length"}]})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _event(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("port", type=int)
    p.add_argument("record_dir", type=Path)
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--hold", type=float, default=60.0)
    a = p.parse_args()
    app = create_stub(a.port, a.record_dir, a.chunks, a.hold)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
