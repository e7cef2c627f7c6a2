"""The built-in character-level tokenizer: exact vocabulary, lossless round trips both ways.

The tokenizers are checked as clients see them: saved, then loaded with ``AutoTokenizer``.
"""

from __future__ import annotations

import random
import time
from functools import cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from flowprefill.models import SIZES, named_model_dir
from flowprefill.models.tokenizer import (
    CHAT_TEMPLATE,
    MAX_VOCAB_SIZE,
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    UNK,
    train_tokenizer,
    vocabulary,
)

BUILT_IN_VOCAB_SIZES = sorted({size.vocab_size for size in SIZES.values()})
ALL_VOCAB_SIZES = sorted({*BUILT_IN_VOCAB_SIZES, MIN_VOCAB_SIZE, MAX_VOCAB_SIZE})
FIRST_CHAR_ID = len(SPECIAL_TOKENS)


@cache
def _saved_dir(vocab_size: int, root: Path) -> Path:
    path = root / f"tok{vocab_size}"
    train_tokenizer(vocab_size).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizers")


def loaded(vocab_size: int, root: Path) -> PreTrainedTokenizerBase:
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        _saved_dir(vocab_size, root), local_files_only=True
    )
    return tokenizer


def test_layout_specials_then_characters() -> None:
    assert BUILT_IN_VOCAB_SIZES == [2048, 32000]  # a new size must be added to these tests
    tokens = vocabulary(32000)
    assert len(tokens) == 32000 and len(set(tokens)) == 32000
    assert tokens[:4] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    assert tokens[4:7] == ["\n", "\t", " "]
    assert all(len(t) == 1 for t in tokens[FIRST_CHAR_ID:])
    # A smaller vocabulary is a prefix of a larger one: ids mean the same in every size.
    assert vocabulary(2048) == tokens[:2048]
    assert "\u00ad" not in tokens and "\u00a0" not in tokens  # soft hyphen, NBSP
    # 32,000 ids end inside the Hangul syllables (after all of CJK U+4E00-U+9FA5).
    assert tokens[-1] == chr(0xAC00 + 32000 - 1 - tokens.index("\uac00"))
    assert "\u9fa5" in tokens and "\ud7a3" not in tokens
    assert MAX_VOCAB_SIZE == 32686
    with pytest.raises(ValueError, match=f"between {MIN_VOCAB_SIZE} and {MAX_VOCAB_SIZE}, got 100"):
        train_tokenizer(100)
    with pytest.raises(ValueError, match="got 40000"):
        vocabulary(40000)


@pytest.mark.parametrize("vocab_size", ALL_VOCAB_SIZES)
def test_every_id_decodes_to_text_that_encodes_back_to_it(vocab_size: int, root: Path) -> None:
    tokenizer = loaded(vocab_size, root)
    assert len(tokenizer) == vocab_size
    ids = list(range(vocab_size))
    # Special tokens are decoded with skip_special_tokens=False: skipped, they are "".
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
    assert all(texts), "every id decodes to some text"
    assert tokenizer(texts, add_special_tokens=True)["input_ids"] == [[i] for i in ids]
    assert (
        tokenizer.batch_decode([[i] for i in ids[:FIRST_CHAR_ID]], skip_special_tokens=True)
        == [""] * FIRST_CHAR_ID
    )


@pytest.mark.parametrize("vocab_size", BUILT_IN_VOCAB_SIZES)
def test_random_id_sequences_round_trip(vocab_size: int, root: Path) -> None:
    tokenizer = loaded(vocab_size, root)

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.integers(FIRST_CHAR_ID, vocab_size - 1), max_size=64))
    def check(ids: list[int]) -> None:
        text = tokenizer.decode(ids)
        # Text spelling a special token encodes as that token in any HF tokenizer.
        assume(not any(special in text for special in SPECIAL_TOKENS))
        assert len(text) == len(ids)
        assert tokenizer(text)["input_ids"] == ids
        # aiperf's count: every streamed piece decoded alone, joined, encoded once.
        joined = "".join(tokenizer.batch_decode([[i] for i in ids]))
        assert tokenizer(joined)["input_ids"] == ids

    check()


def test_text_in_the_vocabulary_round_trips_and_unknown_characters_become_unk(
    root: Path,
) -> None:
    demo, tiny = loaded(32000, root), loaded(2048, root)
    text = "Hello wörld!\tThe prefill of 4,096 tokens took 0.7 s .\nΣπ Привет ひらがな 一"
    for tokenizer in (demo, tiny):
        ids = tokenizer(text)["input_ids"]
        assert len(ids) == len(text)
        assert tokenizer.decode(ids) == text  # " ." kept: no clean-up of spaces
    unk = demo.convert_tokens_to_ids(UNK)
    assert unk == demo.unk_token_id == 3
    # \r, an emoji, NBSP: one <unk> per character, visible on decode, dropped when skipped.
    ids = demo("a\r\U0001f600\u00a0b")["input_ids"]
    assert ids == [demo.convert_tokens_to_ids("a"), unk, unk, unk, demo.convert_tokens_to_ids("b")]
    assert demo.decode(ids, skip_special_tokens=False) == "a<unk><unk><unk>b"
    assert demo.decode(ids, skip_special_tokens=True) == "ab"
    # The first Hangul syllable is past tiny's cut (2,048 ids) but inside demo's.
    assert tiny("\uac00")["input_ids"] == [unk]
    assert demo("\uac00")["input_ids"] == [vocabulary(32000).index("\uac00")]
    # Special tokens in text are special tokens, as in any HF tokenizer.
    assert demo("<|im_end|>")["input_ids"] == [2]


def test_chat_template_and_special_token_roles(root: Path) -> None:
    tokenizer = loaded(2048, root)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<|im_end|>",
        "<|endoftext|>",
        "<unk>",
    )
    assert tokenizer.bos_token is None
    assert sorted(tokenizer.all_special_ids) == [0, 1, 2, 3]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(chat)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2  # im_start / im_end are single ids
    assert tokenizer.decode(ids) == chat


def test_deterministic(tmp_path: Path) -> None:
    for index in range(2):
        train_tokenizer(2048).save_pretrained(tmp_path / str(index))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "0" / name).read_bytes() == (tmp_path / "1" / name).read_bytes()


def test_encoding_a_long_prompt_is_cheap(root: Path) -> None:
    """The gateway tokenizes every prompt: 32K characters in well under a second (a few ms
    on an idle core; the bound only catches a super-linear regression)."""
    tokenizer = loaded(32000, root)
    text = ("The prefill of a long prompt, 一 次. " * 1000)[:32768]
    tokenizer(text)  # warm-up
    start = time.perf_counter()
    ids = tokenizer(text)["input_ids"]
    elapsed = time.perf_counter() - start
    assert len(ids) == 32768
    assert elapsed < 0.5, elapsed


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_vllms_incremental_detokenizer_streams_exactly_the_decoded_text(
    skip_special_tokens: bool, tmp_path: Path
) -> None:
    """What vLLM streams, piece by piece, joins to ``tokenizer.decode(ids)`` (the pieces are
    what a client such as aiperf joins and re-encodes)."""
    pytest.importorskip("vllm")
    from vllm.sampling_params import SamplingParams
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import (
        FastIncrementalDetokenizer,
        IncrementalDetokenizer,
        SlowIncrementalDetokenizer,
    )

    model_dir = named_model_dir("tiny-llama", cache_dir=tmp_path)
    tokenizer = get_tokenizer(str(model_dir))
    rng = random.Random(0)
    params = SamplingParams.from_optional(skip_special_tokens=skip_special_tokens)
    for case in range(20):
        # Mostly characters, some special tokens (ids 0-3) mixed in.
        ids = [rng.choice((rng.randrange(4), rng.randrange(2048))) for _ in range(50)]
        request = EngineCoreRequest(
            request_id=f"r{case}",
            prompt_token_ids=tokenizer.encode("a prompt"),
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        detokenizers = [
            IncrementalDetokenizer.from_new_request(tokenizer, request),
            SlowIncrementalDetokenizer(tokenizer, request),
        ]
        assert isinstance(detokenizers[0], FastIncrementalDetokenizer)  # what vLLM uses
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        for detokenizer in detokenizers:
            pieces = []
            for token_id in ids:
                detokenizer.update([token_id], stop_terminated=False)
                pieces.append(detokenizer.get_next_output_text(finished=False, delta=True))
            assert "".join(pieces) == expected, type(detokenizer).__name__
