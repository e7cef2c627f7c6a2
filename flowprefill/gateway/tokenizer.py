"""Tokenization in the gateway: prompts and chat messages to token ids (prefill and decode
get ids, so both see exactly the same prompt), and a first token id back to text."""

from __future__ import annotations

from typing import Any


class Tokenizer:
    """The few tokenizer operations the gateway needs (a transformers tokenizer fits)."""

    def __init__(self, hf_tokenizer: Any, max_model_len: int, eos_token_ids: set[int]) -> None:
        self.tok = hf_tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._backend = _plain_backend(hf_tokenizer)

    def encode_prompt(self, prompt: str) -> list[int]:
        if self._backend is not None:  # the same ids, without the wrapper's ~3x overhead
            return list(self._backend.encode(prompt, add_special_tokens=True).ids)
        return list(self.tok(prompt, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(t) for t in ids]

    def decode_token(self, token_id: int) -> str:
        return str(self.tok.decode([token_id], skip_special_tokens=True))


def _plain_backend(hf_tokenizer: Any) -> Any:
    """The Rust tokenizer under a transformers fast tokenizer, when calling it directly
    gives what ``hf_tokenizer(text)`` gives: no truncation, padding or special-token
    splitting configured (a call through the wrapper first resets those to its defaults,
    as every call through it does). None otherwise."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if not getattr(hf_tokenizer, "is_fast", False) or backend is None:
        return None
    hf_tokenizer("", add_special_tokens=True)
    plain = (
        backend.truncation is None
        and backend.padding is None
        and not getattr(backend, "encode_special_tokens", False)
    )
    return backend if plain else None
