"""A locally trained byte-level BPE tokenizer whose vocabulary matches the model exactly.

vLLM (and ``AutoTokenizer``) load the saved directory like any Hugging Face checkpoint. The
vocabulary must have exactly the model's ``vocab_size`` entries, otherwise text decoded from
ids the tokenizer does not know comes out empty. The built-in corpus is too small for the BPE
trainer to learn tens of thousands of merges, so the remaining ids are filled with
*decode-only* tokens: concatenations of learned tokens. The encoder never produces them (no
merge leads there), but the byte-level decoder turns them into readable text, so a random
model's output decodes to word salad rather than to nothing.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from flowprefill.models.corpus import corpus_lines

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2 in that order

# ChatML, as Qwen models use it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MIN_VOCAB_SIZE = 512  # 256 byte symbols + specials + room for some merges


def special_token_ids() -> dict[str, int]:
    return {token: index for index, token in enumerate(SPECIAL_TOKENS)}


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on the built-in corpus; exactly ``vocab_size`` ids.

    Deterministic: the same ``vocab_size`` always yields the same tokenizer.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(corpus_lines(), trainer=trainer)
    raw = _fill_vocab(raw, vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        model_max_length=1 << 30,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if len(tokenizer) != vocab_size:  # an invariant, not a user error
        raise AssertionError(f"tokenizer has {len(tokenizer)} ids, wanted {vocab_size}")
    return tokenizer


def _fill_vocab(raw: Tokenizer, vocab_size: int) -> Tokenizer:
    """Append decode-only tokens (pairs of learned tokens) until the vocab is full."""
    state = json.loads(raw.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    missing = vocab_size - len(vocab)
    if missing <= 0:
        return raw
    specials = set(SPECIAL_TOKENS)
    # Prefer word-like pieces (those starting with the byte-level space marker) so the
    # filler decodes to plausible text; order by id for determinism.
    pieces = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in specials]
    words = [t for t in pieces if t.startswith("Ġ") and len(t) > 2] or pieces
    next_id = len(vocab)
    for first in words:
        for second in words:
            candidate = first + second
            if candidate in vocab:
                continue
            vocab[candidate] = next_id
            next_id += 1
            if next_id == vocab_size:
                return Tokenizer.from_str(json.dumps(state))
    raise AssertionError("corpus too small to fill the vocabulary")  # 100s² pairs suffice
