"""Server-sent event framing, as OpenAI's and vLLM's streams use it: one JSON object per
``data:`` line, a blank line after each, ``data: [DONE]`` last."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

MEDIA_TYPE = "text/event-stream"
DONE = "data: [DONE]\n\n"


def sse_event(payload: dict[str, Any] | BaseModel) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"
