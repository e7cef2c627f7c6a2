"""Stage 4 of the pipeline: relay the first token and decode's pieces to the client, as
one OpenAI body or as an OpenAI SSE stream (:mod:`~flowprefill.gateway.openai_wire`).

A failure after the first token: a collected answer raises it (the client gets its
status); a stream, whose 200 is already sent, counts it (``flowprefill_gateway_errors``)
and ends with an error event.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from flowprefill.gateway import openai_wire as wire
from flowprefill.gateway.decode import Piece
from flowprefill.gateway.errors import GatewayError
from flowprefill.gateway.job import Job
from flowprefill.gateway.metrics import GatewayMetrics
from flowprefill.web.sse import DONE


class Relay:
    def __init__(
        self, model_name: str, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.model = model_name
        self.metrics = metrics
        self.clock = clock

    async def stream(
        self, job: Job, first_text: str, pieces: AsyncGenerator[Piece, None]
    ) -> AsyncIterator[str]:
        """SSE events; a client gone mid-stream closes ``pieces`` (and decode) at once."""
        first_s = self.clock()
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
            self._decoded(job, first_s)
            if options is not None and options.include_usage:
                yield wire.usage_event(job, self.model)
        yield DONE

    async def collect(
        self, job: Job, first_text: str, pieces: AsyncGenerator[Piece, None]
    ) -> dict[str, Any]:
        """The whole answer's body; raises :class:`GatewayError`."""
        first_s = self.clock()
        texts = [first_text]
        finish = "length"
        async with aclosing(pieces):
            async for piece in pieces:
                texts.append(piece.text)
                finish = piece.finish_reason or finish
        self._decoded(job, first_s)
        return wire.completion_body(job, self.model, "".join(texts), finish)

    def _decoded(self, job: Job, first_s: float) -> None:
        """TPOT of a finished request: the first token was handed over at ``first_s``."""
        self.metrics.decoded(
            job.slo.name, decode_s=self.clock() - first_s, num_tokens=job.num_completion_tokens
        )
