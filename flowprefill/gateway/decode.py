"""Stage 3 of the pipeline: what follows the first token.

A first token that is end-of-sequence (unless the request asks vLLM's ``ignore_eos``) or
one of its ``stop_token_ids``, or an output budget of one token, ends the request here.
Otherwise a decode instance (vLLM) continues from the prompt *plus* the first token,
loading the prompt's KV through the hand-off (awaited first: the first token went out
before prefill finished writing it), picked with :mod:`~flowprefill.gateway.failover`.

Who deletes the hand-off: once a decode instance may hold the request, its connector
deletes the hand-off when the request ends there (the gateway deleting it too could pull
it from under that instance's load). When none does — first token EOS, client gone before
decode, every instance refused or rejected it — nobody will load it, and this stage
releases it through the prefill instance.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from flowprefill.gateway.errors import UpstreamError
from flowprefill.gateway.failover import Placement, failover
from flowprefill.gateway.job import Job
from flowprefill.gateway.routing import Instance, InstancePool
from flowprefill.gateway.upstream import DecodeClient, DecodeDelta, PrefillAnswer, PrefillClient


@dataclass(frozen=True, slots=True)
class Piece:
    """Text after the first token; ``finish_reason`` set on the last piece."""

    text: str
    finish_reason: str | None = None


@dataclass
class _Custody:
    decode_may_have_it: bool = False


class DecodeStage:
    def __init__(
        self,
        pool: InstancePool | None,
        client: DecodeClient | None,
        prefill_client: PrefillClient,
        eos_token_ids: set[int],
        clock: Callable[[], float],
    ) -> None:
        self.pool = pool
        self.client = client
        self.prefill_client = prefill_client
        self.eos_token_ids = eos_token_ids
        self.clock = clock

    async def continuation(self, job: Job, answer: PrefillAnswer) -> AsyncGenerator[Piece, None]:
        """The pieces after the first token, the last with a finish reason. Raises
        :class:`~flowprefill.gateway.errors.GatewayError` subclasses; a consumer that stops
        early must ``aclose()`` it (the decode stream is then closed at once)."""
        if job.body.first_token_ends(answer.first_token_id, self.eos_token_ids):
            self.prefill_client.release(answer)
            yield Piece("", "stop")
            return
        budget = job.body.output_budget - 1
        if budget <= 0:  # prefill was asked for no hand-off
            yield Piece("", "length")
            return
        custody = _Custody()
        try:
            async with aclosing(self._decode(job, answer, budget, custody)) as pieces:
                async for piece in pieces:
                    yield piece
        finally:
            if not custody.decode_may_have_it:
                self.prefill_client.release(answer)

    async def _decode(
        self, job: Job, answer: PrefillAnswer, budget: int, custody: _Custody
    ) -> AsyncGenerator[Piece, None]:
        pool, client = self.pool, self.client
        if pool is None or client is None:
            raise UpstreamError(503, "this gateway has no decode instances", "no_decode")
        handoff = await answer.hand_off()

        async def attempt(inst: Instance) -> AsyncGenerator[DecodeDelta, None]:
            streamed = False
            custody.decode_may_have_it = True  # from the moment it may reach the instance
            deltas = client.stream(
                inst.url,
                prompt_token_ids=[*job.token_ids, answer.first_token_id],
                max_tokens=budget,
                sampling=job.body.decode_sampling(),
                handoff=handoff,
                headers=job.upstream_hints(self.clock()),
                request_id=job.request_id,
            )
            try:
                async with aclosing(deltas):
                    async for delta in deltas:
                        streamed = True
                        yield delta
            except UpstreamError:
                # Refused, or answered with an error before any output: vLLM did not keep
                # the request, so its connector will not clean up after it.
                custody.decode_may_have_it = streamed
                raise

        finish: str | None = None
        work = Placement(job.request_id, job.deadline_s, budget)
        async with aclosing(failover(pool, work, attempt)) as deltas:
            async for delta in deltas:
                if delta.completion_tokens is not None:
                    job.num_completion_tokens = 1 + delta.completion_tokens
                if delta.text or delta.finish_reason:
                    finish = delta.finish_reason or finish
                    yield Piece(delta.text, delta.finish_reason)
        if finish is None:
            yield Piece("", "length")
