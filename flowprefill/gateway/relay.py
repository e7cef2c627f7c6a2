"""Stage 4 of the pipeline: relay the first token and decode's pieces to the client, as
one OpenAI body or as an OpenAI SSE stream (:mod:`~flowprefill.gateway.openai_wire`).

A failure after the first token: a collected answer raises it (the client gets its
status); a stream, whose 200 is already sent, counts it (``flowprefill_gateway_errors``)
and ends with an error event.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from flowprefill.gateway import openai_wire as wire
from flowprefill.gateway.decode import Piece
from flowprefill.gateway.errors import GatewayError
from flowprefill.gateway.job import Job
from flowprefill.gateway.metrics import GatewayMetrics
from flowprefill.web.sse import DONE


class Relay:
    def __init__(self, model_name: str, metrics: GatewayMetrics) -> None:
        self.model = model_name
        self.metrics = metrics

    async def stream(
        self, job: Job, first_text: str, pieces: AsyncGenerator[Piece, None]
    ) -> AsyncIterator[str]:
        """SSE events; a client gone mid-stream closes ``pieces`` (and decode) at once."""
        yield wire.chunk_event(job, self.model, first_text, None, first=True)
        options = job.body.stream_options
        try:
            async with aclosing(pieces):
                async for piece in pieces:
                    yield wire.chunk_event(job, self.model, piece.text, piece.finish_reason)
        except GatewayError as e:
            self.metrics.failed(e)
            yield wire.error_event(e)
        else:  # as vLLM does: no usage after an error event
            if options is not None and options.include_usage:
                yield wire.usage_event(job, self.model)
        yield DONE

    async def collect(
        self, job: Job, first_text: str, pieces: AsyncGenerator[Piece, None]
    ) -> dict[str, Any]:
        """The whole answer's body; raises :class:`GatewayError`."""
        texts = [first_text]
        finish = "length"
        async with aclosing(pieces):
            async for piece in pieces:
                texts.append(piece.text)
                finish = piece.finish_reason or finish
        return wire.completion_body(job, self.model, "".join(texts), finish)
