"""How much of a hand-off decode loads: arithmetic on token counts, shared by the
connector's scheduler side and the tests. The hand-off reference itself is a contract
(:mod:`flowprefill.contracts.kv`)."""

from __future__ import annotations


def load_end(num_kv_tokens: int, num_request_tokens: int) -> int:
    """How far into the request the hand-off's KV can be used (exclusive token index).

    vLLM must run the model on at least the last token of a new request to get logits to
    sample from (its scheduler asserts it schedules > 0 tokens), so at most
    ``num_request_tokens - 1`` tokens can come from outside. When the gateway sends
    ``prompt + [first_token]`` (the recommended shape) that bound is the whole prompt and
    decode recomputes nothing; when it sends the bare prompt, decode recomputes the last
    prompt token and re-samples the first token.
    """
    return max(0, min(num_kv_tokens, num_request_tokens - 1))


def num_tokens_to_load(num_kv_tokens: int, num_request_tokens: int, num_computed: int) -> int:
    """Tokens to load beyond the ``num_computed`` vLLM already holds (its prefix cache)."""
    return max(0, load_end(num_kv_tokens, num_request_tokens) - num_computed)
