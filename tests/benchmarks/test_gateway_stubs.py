"""The gateway benchmarks' stub decode speaks vLLM's usage options as vLLM does, so a
benchmark that asks for them measures the gateway's real path."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from benchmarks.gateway.stubs import DECODE_TOKENS, decode_events


def _chunks(options: dict[str, bool] | None) -> list[dict[str, Any]]:
    body: dict[str, Any] = {"prompt": [5, 6, 7], "max_tokens": DECODE_TOKENS}
    if options is not None:
        body["stream_options"] = options

    async def collect() -> list[str]:
        return [event async for event in decode_events(body)]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_continuous_usage_counts_every_chunk_and_ends_with_the_total() -> None:
    chunks = _chunks({"include_usage": True, "continuous_usage_stats": True})
    token_chunks, last = chunks[:-1], chunks[-1]
    assert [c["usage"]["completion_tokens"] for c in token_chunks] == list(
        range(1, DECODE_TOKENS + 1)
    )
    assert all(c["usage"]["prompt_tokens"] == 3 for c in token_chunks)
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": DECODE_TOKENS,
        "total_tokens": 3 + DECODE_TOKENS,
    }


@pytest.mark.parametrize(
    "options", [None, {"include_usage": False, "continuous_usage_stats": True}]
)
def test_no_usage_without_include_usage(options: dict[str, bool] | None) -> None:
    # As in vLLM: continuous_usage_stats alone asks for nothing.
    chunks = _chunks(options)
    assert len(chunks) == DECODE_TOKENS
    assert all("usage" not in c for c in chunks)


def test_include_usage_alone_gives_one_usage_chunk() -> None:
    chunks = _chunks({"include_usage": True})
    assert all("usage" not in c for c in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == DECODE_TOKENS
