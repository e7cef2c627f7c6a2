"""Save tiny models as standard Hugging Face directories, and load models by name or path.

A saved directory holds ``config.json``, ``generation_config.json``,
``model.safetensors`` and the tokenizer files, so
``AutoModelForCausalLM.from_pretrained(path)``, ``AutoTokenizer.from_pretrained(path)`` and
vLLM all load it offline.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from flowprefill.contracts.deployment import MODEL_CACHE_ENV
from flowprefill.errors import UnknownNameError
from flowprefill.models.builders import build_named, model_names, parse_name
from flowprefill.models.tokenizer import (
    CHAT_TEMPLATE,
    IM_END,
    TOKENIZER_FORMAT,
    special_token_ids,
    train_tokenizer,
)

CACHE_ENV = MODEL_CACHE_ENV


def default_cache_dir() -> Path:
    """Where named models are materialised: ``$FLOWPREFILL_MODEL_CACHE`` or ~/.cache."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path.home() / ".cache" / "flowprefill" / "models"


def save_model_dir(model: PreTrainedModel, path: str | os.PathLike[str]) -> Path:
    """Write ``model`` plus a tokenizer trained for its vocab size to ``path``.

    Written to a sibling temporary directory and renamed into place, so a crash (or a
    concurrent writer) never leaves a half-written model that later loads as corrupt.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    ids = special_token_ids()
    # Greedy by default: vLLM takes a request's unset sampling fields from here (it reads
    # top_k, not do_sample), so decode picks tokens as the prefill engine does (argmax)
    # and a client that sends no temperature gets a reproducible answer.
    GenerationConfig(
        eos_token_id=[ids[IM_END], model.config.pad_token_id],
        pad_token_id=model.config.pad_token_id,
        do_sample=True,
        top_k=1,
    ).save_pretrained(tmp)
    tokenizer = train_tokenizer(model.config.vocab_size)
    tokenizer.save_pretrained(tmp)
    _make_tokenizer_config_portable(tmp / "tokenizer_config.json")
    try:
        tmp.rename(target)
    except OSError:
        # Another process won the race (target exists and is not empty): keep theirs.
        _rmtree(tmp)
        if not (target / "config.json").exists():
            raise
    return target


def _make_tokenizer_config_portable(config_path: Path) -> None:
    """Name the generic fast tokenizer class, inline the chat template, and list the extra
    special tokens as ``additional_special_tokens``.

    transformers 5 writes ``TokenizersBackend`` and a separate ``chat_template.jinja``;
    older loaders (and some vLLM paths) only understand ``PreTrainedTokenizerFast`` and a
    ``chat_template`` field, and both spellings load in transformers 5.
    """
    data = json.loads(config_path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    # transformers 5's list of unnamed specials; older loaders know it by its old name.
    if isinstance(data.get("extra_special_tokens"), list):
        data["additional_special_tokens"] = data.pop("extra_special_tokens")
    data["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(data, indent=2) + "\n")


def _rmtree(path: Path) -> None:
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def named_model_dir_name(name: str, seed: int = 0) -> str:
    """The cache directory name of a named model: ``{name}-seed{seed}-tok{format}``.

    The tokenizer format (:data:`~flowprefill.models.tokenizer.TOKENIZER_FORMAT`) is part
    of it so a model cached with an older built-in tokenizer is never reused by name (it
    still loads when passed by path).
    """
    return f"{name}-seed{seed}-tok{TOKENIZER_FORMAT}"


def named_model_dir(
    name: str, seed: int = 0, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Directory of the named tiny model (``cache_dir / named_model_dir_name(name, seed)``),
    building and saving it on first use."""
    parse_name(name)  # raises UnknownNameError early
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = root / named_model_dir_name(name, seed)
    if not (path / "config.json").exists():
        save_model_dir(build_named(name, seed=seed), path)
    return path


def resolve_model_path(
    path_or_name: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """A local model directory, or a built-in name materialised into the cache."""
    candidate = Path(path_or_name)
    if candidate.is_dir():
        return candidate
    name = str(path_or_name)
    if name in model_names():
        return named_model_dir(name, cache_dir=cache_dir)
    raise UnknownNameError("model (name or local directory)", name, model_names())


def load_model(
    path_or_name: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike[str] | None = None,
) -> PreTrainedModel:
    """Load a causal LM in eval mode with sdpa attention, offline."""
    path = resolve_model_path(path_or_name, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa", local_files_only=True
    )
    torch.nn.Module.to(model, torch.device(device))
    model.eval()
    return model
