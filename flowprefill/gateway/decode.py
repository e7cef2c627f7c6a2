"""Stage 3 of the pipeline: what follows the first token.

A first token that is end-of-sequence (unless the request asks vLLM's ``ignore_eos``) or
one of its ``stop_token_ids``, or an output budget of one token, ends the request here.
Otherwise a decode instance (vLLM) continues from the prompt *plus* the first token,
loading the prompt's KV through the hand-off (awaited first: the first token went out
before prefill finished writing it), picked with :func:`~flowprefill.gateway.routing.failover`.

**Colocated pairing.** When the prefill instance that answered is colocated with a decode
of its own (the answer's ``decode_url``, a pod of a ``role: colocated`` pool), the first
attempt goes there (:meth:`~flowprefill.gateway.routing.InstancePool.paired`: only to a
decode instance this gateway lists, or the pod behind one on the prefill instance's host),
booked in the decode pool's in-flight book like any other, so the KV hand-off stays inside
the pod. The retry rule is unchanged: when that attempt fails in a way that is safe to
retry, the second goes where the pool picks (with NIXL, recomputing the prompt); while that
pod's decode is in its back-off, the first goes where the pool picks. No ``decode_url``,
or one that names nothing this gateway may send to: the pool picks, as for any request.

Who deletes the hand-off (a file of up to GBs that prefill's age sweep would otherwise
keep for minutes): this stage releases it through the prefill instance
(:meth:`~flowprefill.gateway.upstream.PrefillClient.release`, in the background) as soon
as no decode instance can still load it *for this request*:

* nobody was asked to: the first token ended the answer, the client left before decode,
  no decode instance could be picked;
* decode finished: vLLM calls the connector's ``request_finished`` before it sends the
  finish reason, and a finished request never loads again. The connector's own delete
  (``DELETE_GRACE_S`` later) then finds nothing; the gateway's does not wait for it,
  because a decode process killed within that grace takes its pending delete with it;
* the gateway gave up on decode (every attempt failed; the client gets the error): an
  instance that answered an error or refused did not keep the request, one that died
  has no connector left to delete anything, and one whose connection the gateway
  dropped (stalled, a timeout, a stream error) aborts the request.

Never while an attempt is live: a retry on another instance is that instance's to load,
so the release waits until it has finished or failed too. The one case left to decode's
connector is a client that leaves while an attempt is live: that instance may be loading it
right now (vLLM's batch queue can run a step scheduled before the abort), and its
connector deletes it after the abort's grace. A release can still meet a load on an
instance the gateway has already dropped (a stalled one that resumes with a step
scheduled): that load finds no hand-off and vLLM recomputes the prompt — the connector's
fallback for a missing hand-off — for a request whose output nobody reads. A second
delete (connector and gateway both) finds nothing and is harmless.

Usage: decode's reports set the request's completion tokens (1, the first token, plus
decode's), in every chunk when the client asked for vLLM's ``continuous_usage_stats``.
Decode's ``prompt_tokens_details.cached_tokens`` (vLLM with
``--enable-prompt-tokens-details``) is the client's only when decode computed the prompt
itself (no hand-off: a recompute): vLLM counts every prompt token it did not compute,
so with a hand-off loaded it counts the tokens prefill computed *for this request* —
nearly the whole prompt, not a cache hit. vLLM's own P/D has decode report the prefill
side's hits instead (``remote_prefill_cached_tokens``); FlowPrefill's prefill has no
prefix cache and reports none, so then the field is left out, never made up.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from flowprefill.contracts.nixl import RemotePrefill
from flowprefill.gateway.classify import Job
from flowprefill.gateway.errors import GatewayError, UpstreamError
from flowprefill.gateway.routing import Admitted, Instance, InstancePool, Placement, failover
from flowprefill.gateway.upstream import DecodeClient, DecodeDelta, PrefillAnswer, PrefillClient


@dataclass(frozen=True, slots=True)
class Piece:
    """Text after the first token; ``finish_reason`` set on the last piece."""

    text: str
    finish_reason: str | None = None


@dataclass
class _Custody:
    attempt_live: bool = False
    """A decode attempt is running on an instance that may be loading the hand-off."""


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
        # The decode runs in this generator itself, not in one nested in it: each piece
        # would pass one more generator on its way to the client.
        pool, client = self.pool, self.client
        custody = _Custody()
        try:
            if pool is None or client is None:
                raise UpstreamError(503, "this gateway has no decode instances", "no_decode")
            handoff = await answer.hand_off()
            attempts = 0
            loads_handoff = False  # whether the attempt now streaming loads the prompt's KV

            async def attempt(inst: Instance) -> AsyncGenerator[DecodeDelta, None]:
                nonlocal attempts, loads_handoff
                assert client is not None
                attempts += 1
                # NIXL blocks are freed once a decode has read them, and may hold another
                # prompt's KV by the time a retry would read them: a retry recomputes.
                kv = None if attempts > 1 and isinstance(handoff, RemotePrefill) else handoff
                loads_handoff = kv is not None
                custody.attempt_live = True  # from the moment it may reach the instance
                deltas = client.stream(
                    inst.url,
                    prompt_token_ids=[*job.token_ids, answer.first_token_id],
                    max_tokens=budget,
                    sampling=job.body.decode_sampling(),
                    handoff=kv,
                    headers=job.upstream_hints(self.clock()),
                    request_id=job.request_id,
                    continuous_usage=job.body.usage_in_chunks,
                )
                try:
                    async with aclosing(deltas):
                        async for delta in deltas:
                            yield delta
                except UpstreamError:
                    # Refused, answered an error, died or broke the stream: that instance
                    # will not load it (it did not keep the request, has no connector left,
                    # or aborts it); a retry elsewhere is live again from its start.
                    custody.attempt_live = False
                    raise
                custody.attempt_live = False  # finished there ([DONE]): vLLM freed it first

            finish: str | None = None
            work = Placement(job.request_id, job.deadline_s, budget)
            colocated = answer.response.decode_url
            pod = pool.paired(colocated, near=answer.prefill_url) if colocated else None
            admitted = Admitted(job.request_id, pod) if pod is not None else None
            async with aclosing(failover(pool, work, attempt, admitted)) as deltas:
                async for delta in deltas:
                    # Counted before the piece is relayed: its chunk carries the count so far.
                    if delta.completion_tokens is not None:
                        job.num_completion_tokens = 1 + delta.completion_tokens
                    if delta.cached_tokens is not None and not loads_handoff:
                        job.cached_tokens = delta.cached_tokens
                    if delta.text or delta.finish_reason:
                        finish = delta.finish_reason or finish
                        yield Piece(delta.text, delta.finish_reason)
            if finish is None:
                yield Piece("", "length")
        except GatewayError:
            custody.attempt_live = False  # given up on decode: no instance will load it
            raise
        finally:
            # Finished, given up, or never sent: released. Left to decode only when the
            # client stopped reading while an attempt was live (see the module docstring).
            if not custody.attempt_live:
                self.prefill_client.release(answer)
