"""A character-level tokenizer whose vocabulary matches the built-in models' exactly.

Every id is a special token or one character, so text and ids convert both ways without
loss, which a benchmark client needs for a *random* model's output:

- each id decodes to text that encodes back to that id (special tokens when they are not
  skipped on decode);
- any sequence of non-special ids decodes to text that encodes back to the same sequence
  (unless the text happens to spell a special token such as ``<|im_end|>``, which every
  Hugging Face tokenizer encodes as the special token). A tokenizer with multi-character
  tokens cannot promise this (``"Ġthe" + "re"`` re-encodes as ``"Ġthere"``), and clients such
  as aiperf count output tokens by encoding the joined stream text.

Layout: ids 0-3 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and ``<unk>``; then
single characters in a fixed order taken from explicit code-point ranges that have been
fully assigned since old Unicode versions (so the vocabulary never depends on Python's
``unicodedata``), cut at exactly ``vocab_size``. A character outside the vocabulary (``\\r``,
an emoji, a CJK ideograph past the cut...) encodes to ``<unk>`` (one per character): it does
not vanish silently, but it does not come back on decode either.

Saved with the ``tokenizers`` library (a BPE model over single characters without merges,
no pre-tokenizer, a decoder that concatenates), so
``AutoTokenizer``, vLLM and the gateway load the directory like any Hugging Face checkpoint.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<unk>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, UNK)  # ids 0, 1, 2, 3 in that order

TOKENIZER_FORMAT = 2
"""Bumped whenever the built-in tokenizer's ids change (1: byte-level BPE on a built-in
corpus; 2: characters). Part of the named-model cache directory's name, so a model cached
with an older tokenizer is never silently reused."""

# ChatML, as Qwen models use it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Inclusive code-point ranges, in vocabulary order. All assigned since Unicode 3.2 (2002)
# at the latest (most since 1.1; Hangul syllables 2.0; U+3095-U+3096 3.2), and listed
# here rather than read from ``unicodedata``, so no Python version changes the ids. The
# two holes in _EXCLUDED: U+00AD soft hyphen is invisible, U+03A2 is unassigned.
_CHAR_RANGES: tuple[tuple[int, int], ...] = (
    (0x0020, 0x007E),  # ASCII printable
    (0x00A1, 0x00FF),  # Latin-1 Supplement (no NBSP)
    (0x0100, 0x017F),  # Latin Extended-A
    (0x0391, 0x03A9),  # Greek capitals
    (0x03B1, 0x03C9),  # Greek smalls
    (0x0410, 0x044F),  # Cyrillic basic
    (0x3041, 0x3096),  # Hiragana
    (0x30A1, 0x30FA),  # Katakana
    (0x4E00, 0x9FA5),  # CJK Unified Ideographs (Unicode 1.1 block)
    (0xAC00, 0xD7A3),  # Hangul syllables
)
_EXCLUDED = frozenset({0x00AD, 0x03A2})

MIN_VOCAB_SIZE = 512  # the specials, ASCII, Latin, Greek, Cyrillic and some kana


def _characters() -> list[str]:
    chars = ["\n", "\t"]
    for first, last in _CHAR_RANGES:
        chars.extend(chr(c) for c in range(first, last + 1) if c not in _EXCLUDED)
    return chars


MAX_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(_characters())


def special_token_ids() -> dict[str, int]:
    return {token: index for index, token in enumerate(SPECIAL_TOKENS)}


def vocabulary(vocab_size: int) -> list[str]:
    """The ``vocab_size`` tokens, index = id; ValueError outside the supported sizes."""
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be between {MIN_VOCAB_SIZE} and {MAX_VOCAB_SIZE}, got {vocab_size}"
        )
    return [*SPECIAL_TOKENS, *_characters()[: vocab_size - len(SPECIAL_TOKENS)]]


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """The character-level tokenizer with exactly ``vocab_size`` ids.

    Deterministic: the same ``vocab_size`` always yields the same tokenizer (nothing is
    learned; the name is kept from the BPE this replaced). ValueError for a size outside
    ``MIN_VOCAB_SIZE``..``MAX_VOCAB_SIZE``.
    """
    tokens = vocabulary(vocab_size)
    # A BPE without merges splits its input into characters and looks each one up (an
    # unknown one becomes one <unk>). No pre-tokenizer: the model already works per
    # character, and a pre-tokenizer isolating characters (or a WordLevel model behind
    # one) makes encoding ~3x slower.
    vocab = {token: index for index, token in enumerate(tokens)}
    raw = Tokenizer(models.BPE(vocab, [], unk_token=UNK))
    # Without a decoder, tokenizers joins tokens with spaces.
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=UNK,
        # Named too, so all_special_ids (which vLLM's slow detokenizer skips) has all four.
        extra_special_tokens=[IM_START],
        model_max_length=1 << 30,
        # transformers' clean-up would rewrite " ." to "." and break the round trip.
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if len(tokenizer) != vocab_size:  # an invariant, not a user error
        raise AssertionError(f"tokenizer has {len(tokenizer)} ids, wanted {vocab_size}")
    return tokenizer
