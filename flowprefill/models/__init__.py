"""Tiny random models and tokenizers for tests, demos and benchmarks (no downloads)."""

from flowprefill.models.builders import (
    FAMILIES,
    SIZES,
    ModelSize,
    build_config,
    build_model,
    build_named,
    model_names,
    parse_name,
)
from flowprefill.models.loader import (
    default_cache_dir,
    load_model,
    named_model_dir,
    named_model_dir_name,
    resolve_model_path,
    save_model_dir,
)
from flowprefill.models.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, train_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "FAMILIES",
    "SIZES",
    "SPECIAL_TOKENS",
    "ModelSize",
    "build_config",
    "build_model",
    "build_named",
    "default_cache_dir",
    "load_model",
    "model_names",
    "named_model_dir",
    "named_model_dir_name",
    "parse_name",
    "resolve_model_path",
    "save_model_dir",
    "train_tokenizer",
]
