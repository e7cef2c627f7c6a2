"""A model directory's tokenizer and config as the gateway reads them, without transformers
(and so without torch): ``tokenizer.json`` through the ``tokenizers`` library, the special
tokens and chat templates of ``tokenizer_config.json`` (and ``chat_template.jinja``,
``additional_chat_templates/*.jinja``), and the few fields of ``config.json`` the gateway
uses.

:class:`FileTokenizer` gives the ids transformers 5's generic fast tokenizer
(``PreTrainedTokenizerFast``, i.e. ``TokenizersBackend``) gives for the same directory: it
makes the same calls on the same ``tokenizers.Tokenizer``, in the same order (special
tokens named in ``tokenizer_config.json`` but missing from ``tokenizer.json`` are added,
truncation and padding are off), and renders chat templates as ``apply_chat_template``
does (the same sandboxed jinja environment, filters, globals and variables). Like
transformers 5, it does not apply ``add_bos_token``/``add_eos_token`` from
``tokenizer_config.json``: with a ``tokenizer.json`` its post-processor alone says what
encoding with special tokens adds. Model-specific transformers classes (e.g.
``LlamaTokenizer``) rebuild the pipeline from the vocabulary instead of reading
``tokenizer.json``'s; this loader reads the file as saved.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as RustTokenizer

from flowprefill.gateway.chat_template import render_chat_template

# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES), in its order.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# transformers' model_max_length when tokenizer_config.json has none (VERY_LARGE_INTEGER).
UNBOUNDED_MODEL_MAX_LENGTH = int(1e30)

# The names config.json files give the longest prompt the model embeds: AutoConfig maps
# max_position_embeddings onto these for the model types that use them (GPT-2's n_positions).
_MAX_POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "context_length",
    "model_max_length",
)


@dataclass(frozen=True)
class ModelConfig:
    """What the gateway reads from ``config.json``: ``max_position_embeddings`` (None when
    the file names no length), the end-of-sequence ids and ``vocab_size`` (None when
    absent). A multimodal config's ``text_config`` is read where the top level lacks a
    field. Values come from the file alone: transformers' per-model defaults for fields
    the file omits are not applied."""

    max_position_embeddings: int | None
    eos_token_ids: frozenset[int]
    vocab_size: int | None


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """``config.json`` of ``model_dir``. Raises OSError when it cannot be read, ValueError
    when it is not a JSON object."""
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError(f"{model_dir}/config.json is not a JSON object")
    text = raw.get("text_config")
    scopes = [raw] + ([text] if isinstance(text, dict) else [])

    def first(keys: Sequence[str]) -> Any:
        for scope in scopes:
            for key in keys:
                if scope.get(key) is not None:
                    return scope[key]
        return None

    length = first(_MAX_POSITION_KEYS)
    eos = first(["eos_token_id"])
    vocab = first(["vocab_size"])
    eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return ModelConfig(
        max_position_embeddings=int(length) if length is not None else None,
        eos_token_ids=frozenset(int(i) for i in eos_ids),
        vocab_size=int(vocab) if vocab is not None else None,
    )


class FileTokenizer:
    """A model directory's fast tokenizer, loaded with ``tokenizers`` and jinja2 alone.

    Offers what :class:`flowprefill.gateway.tokens.Tokenizer` calls on a transformers
    tokenizer, with the same results: ``__call__`` (``{"input_ids": [...]}``),
    :meth:`apply_chat_template`, :meth:`decode`, :meth:`convert_ids_to_tokens`, ``len()``,
    ``eos_token_id``, ``backend_tokenizer``. ``chat_template`` may be reassigned (a
    string, or a dict of named templates)."""

    is_fast = True

    def __init__(
        self,
        backend: RustTokenizer,
        *,
        special_tokens: Mapping[str, str | AddedToken],
        extra_special_tokens: Sequence[str | AddedToken] = (),
        added_tokens_decoder: Mapping[int, AddedToken] | None = None,
        chat_template: str | dict[str, str] | None = None,
        model_max_length: int = UNBOUNDED_MODEL_MAX_LENGTH,
        split_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool = False,
        clean_up_bpe: bool = False,
    ) -> None:
        """``backend`` as read from ``tokenizer.json`` (it is modified as transformers'
        ``TokenizersBackend.__init__`` modifies it); ``special_tokens``: the named ones
        (``bos_token`` ..., and model-specific ``*_token`` names); ``added_tokens_decoder``:
        tokenizer_config.json's, by id."""
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.split_special_tokens = split_special_tokens
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._clean_up_bpe = clean_up_bpe
        self._special = {k: v for k, v in special_tokens.items() if v is not None}
        # transformers leaves the file's truncation and padding on the backend and switches
        # both off on every call that asks for neither, as every gateway call does.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = split_special_tokens
        # Special tokens named in the config but not in the vocabulary are added, as
        # TokenizersBackend.__init__ adds them (same list, same order, same call).
        to_add: list[str | AddedToken] = [
            t for _, t in sorted((added_tokens_decoder or {}).items(), key=lambda kv: kv[0])
        ]
        known = [t.content for t in backend.get_added_tokens_decoder().values()]
        known += [str(t) for t in to_add]
        for value in [*self._special.values(), *extra_special_tokens]:
            if str(value) not in known and value not in to_add:
                to_add.append(value)
        named = {str(v) for v in self._special.values()}
        tokens: list[str | AddedToken] = []
        for token in to_add:
            if isinstance(token, str):
                token = AddedToken(token, special=True)
            elif not token.special and str(token) in named:
                token.special = True
            tokens.append(token)
        if tokens:
            backend.add_tokens(tokens)
        if backend.post_processor is None:
            # TokenizersBackend.update_post_processor without add_bos/add_eos: adds nothing.
            backend.post_processor = processors.TemplateProcessing(
                single="$A:0", pair="$A:0 $B:1", special_tokens=[]
            )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> FileTokenizer:
        """The tokenizer saved in ``model_dir``. Raises FileNotFoundError without a
        ``tokenizer.json`` (slow-only tokenizers are not converted), ValueError for a
        special token that is neither a string nor an AddedToken object."""
        root = Path(model_dir)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{root} has no tokenizer.json: the gateway loads fast tokenizers only "
                "(save the tokenizer with transformers' save_pretrained to write one)"
            )
        backend = RustTokenizer.from_file(str(tokenizer_file))
        config = _read_json(root / "tokenizer_config.json")
        config.pop("add_bos_token", None)  # transformers 5 drops both with a tokenizer.json
        config.pop("add_eos_token", None)
        _rename_additional(config)

        added: dict[int, AddedToken] = {}
        if "added_tokens_decoder" in config:
            for index, token in dict(config.pop("added_tokens_decoder")).items():
                added[int(index)] = _added_token(token, f"added_tokens_decoder[{index}]")
            by_content = {t.content: t for t in added.values()}
        else:
            # Older saves: special_tokens_map.json names them, tokenizer.json's added_tokens
            # say how each one matches.
            for key, value in _read_json(root / "special_tokens_map.json").items():
                if isinstance(value, dict) and key != "extra_special_tokens":
                    fields = {k: v for k, v in value.items() if k != "special"}
                    value = AddedToken(**fields, special=True)
                config[key] = value
            _rename_additional(config)
            by_content = {t.content: t for t in backend.get_added_tokens_decoder().values()}

        special: dict[str, str | AddedToken] = {}
        extra: list[str | AddedToken] = []
        for key, value in config.items():
            if key == "extra_special_tokens":
                if isinstance(value, dict):
                    for name, tok in value.items():
                        special[name] = _special_token(tok, f"extra_special_tokens.{name}")
                elif isinstance(value, list):
                    extra = [_special_token(t, "extra_special_tokens") for t in value]
            elif key in SPECIAL_TOKEN_NAMES and value is not None:
                token = _special_token(value, key)
                special[key] = by_content.get(str(token), token) if by_content else token
            elif key.endswith("_token") and (isinstance(value, str) or _is_added_token_dict(value)):
                special[key] = _special_token(value, key)
        padding = backend.padding
        if padding is not None and "pad_token" not in config:
            special["pad_token"] = str(padding["pad_token"])

        max_len = config.get("model_max_length", config.get("max_len"))
        return cls(
            backend,
            special_tokens=special,
            extra_special_tokens=extra,
            added_tokens_decoder=added,
            chat_template=_chat_templates(root, config.get("chat_template")),
            model_max_length=int(max_len) if max_len is not None else UNBOUNDED_MODEL_MAX_LENGTH,
            split_special_tokens=bool(config.get("split_special_tokens", False)),
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
            clean_up_bpe=bool(
                config.get(
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                    False,
                )
            ),
        )

    # --- tokens ---------------------------------------------------------------------------

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens as text: the variables a chat template sees."""
        return {name: str(value) for name, value in self._special.items()}

    @property
    def eos_token_id(self) -> int | None:
        eos = self._special.get("eos_token")
        return self.backend_tokenizer.token_to_id(str(eos)) if eos is not None else None

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """transformers' ``decode``: the backend's decoder, then (only when the config asks
        and the model is not BPE, which it would corrupt) its space clean-up."""
        text = str(
            self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        )
        is_bpe = type(self.backend_tokenizer.model).__name__ == "BPE"
        if self.clean_up_tokenization_spaces and (not is_bpe or self._clean_up_bpe):
            text = _clean_up_tokenization(text)
        return text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Each id's vocabulary entry; None for an id the tokenizer does not know."""
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    # --- chats ----------------------------------------------------------------------------

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> str | list[int]:
        """transformers' ``apply_chat_template`` for one conversation: the text
        (``tokenize=False``) or its ids encoded without special tokens (the template writes
        them). ``kwargs`` are template variables; they override special tokens of the
        same name. Raises ValueError (with transformers' messages) for a missing template
        or an impossible request, ``jinja2.TemplateError`` for a template that fails or
        calls ``raise_exception``."""
        template = self._template(tools)
        if not conversation:
            raise ValueError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt are not compatible. Use "
                "continue_final_message when you want the model to continue the final message, "
                "and add_generation_prompt when you want to add a header that will prompt it to "
                "start a new assistant message instead."
            )
        text = render_chat_template(
            template,
            conversation,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **{**self.special_tokens_map, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self, tools: list[dict[str, Any]] | None) -> str:
        """transformers' ``get_chat_template`` with no template passed in."""
        if isinstance(self.chat_template, dict):
            templates = self.chat_template
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(
                "This model has multiple chat templates with no default specified! Please either "
                "pass a chat template or the name of the template you wish to use to the "
                "`chat_template` argument. Available template names are "
                f"{sorted(templates.keys())}."
            )
        if self.chat_template is None:
            raise ValueError(
                "Cannot use chat template functions because tokenizer.chat_template is not set "
                "and no template argument was passed! For information about writing templates "
                "and setting the tokenizer.chat_template attribute, please see the documentation "
                "at https://huggingface.co/docs/transformers/main/en/chat_templating"
            )
        return self.chat_template


def _clean_up_tokenization(text: str) -> str:
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _rename_additional(config: dict[str, Any]) -> None:
    # transformers 5 reads the older name when the newer one is absent or empty.
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")


def _is_added_token_dict(value: Any) -> bool:
    return isinstance(value, dict) and value.get("__type") == "AddedToken"


def _added_token(value: Any, where: str) -> AddedToken:
    if isinstance(value, AddedToken):
        return value
    if isinstance(value, dict) and "content" in value:
        return AddedToken(**{k: v for k, v in value.items() if k != "__type"})
    raise ValueError(f"tokenizer_config.json: {where} is not an AddedToken object: {value!r}")


def _special_token(value: Any, where: str) -> str | AddedToken:
    if isinstance(value, (str, AddedToken)):
        return value
    if _is_added_token_dict(value):
        return _added_token(value, where)
    raise ValueError(
        f"tokenizer_config.json: {where} must be a string or an AddedToken object, got {value!r}"
    )


def _chat_templates(root: Path, configured: Any) -> str | dict[str, str] | None:
    """The directory's templates as transformers loads them: ``chat_template.jinja`` and
    ``additional_chat_templates/<name>.jinja`` win over tokenizer_config.json's
    ``chat_template`` (a string, or a list of ``{"name", "template"}``); a lone default is
    a string, several are a dict by name."""
    found: dict[str, str] = {}
    default = root / "chat_template.jinja"
    if default.is_file():
        found["default"] = default.read_text(encoding="utf-8")
    extra = root / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            found[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if found:
        return found["default"] if list(found) == ["default"] else found
    if isinstance(configured, (list, tuple)):
        return {str(t["name"]): str(t["template"]) for t in configured}
    return str(configured) if configured is not None else None
