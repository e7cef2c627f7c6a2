"""Checks on hand-off metadata read from an untrusted file or HTTP body.

A hand-off comes from a shared volume or a pod on the network, either of which may be
broken or hostile. Every number in its metadata decides how much the reader builds
(names per layer, shapes), so each is type-checked and bounded here *before* it is used:
a header that declares a billion layers must be refused at once, not after the reader
has tried to build a billion tensor names. Violations are ``ValueError`` (the callers
turn them into :class:`~flowprefill.errors.KVFormatError` naming the file or URL).
"""

from __future__ import annotations

from typing import Any

# Generous bounds: far beyond any model served today, small enough that the reader's
# per-layer work (names, shape checks) stays trivial whatever a header declares.
MAX_LAYERS = 4096
MAX_KV_HEADS = 1 << 16
MAX_HEAD_DIM = 1 << 16
MAX_DIM = 1 << 24  # hidden_size, vocab_size
MAX_NUM_TOKENS = 1 << 31

_INT_BOUNDS = {
    "num_layers": MAX_LAYERS,
    "num_kv_heads": MAX_KV_HEADS,
    "head_dim": MAX_HEAD_DIM,
    "hidden_size": MAX_DIM,
    "vocab_size": MAX_DIM,
}
_FIELDS = {"model_type", "rope_theta", *_INT_BOUNDS}


def bounded_int(name: str, value: object, high: int, low: int = 1) -> int:
    """``value`` if it is an int (not a bool) in [low, high]; else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r:.40}")
    return value


def fingerprint_fields(obj: Any) -> dict[str, Any]:
    """The keyword arguments of ``ModelFingerprint`` from its decoded JSON, checked."""
    if not isinstance(obj, dict):
        raise ValueError(f"fingerprint must be a JSON object, got {type(obj).__name__}")
    unknown, missing = set(obj) - _FIELDS, (_FIELDS - {"rope_theta"}) - set(obj)
    if unknown or missing:
        raise ValueError(
            f"fingerprint fields unknown {sorted(unknown)[:4]}, missing {sorted(missing)}"
        )
    out: dict[str, Any] = {
        name: bounded_int(name, obj[name], high) for name, high in _INT_BOUNDS.items()
    }
    model_type = obj["model_type"]
    if not isinstance(model_type, str) or not 0 < len(model_type) <= 128:
        raise ValueError(f"model_type must be a short string, got {model_type!r:.40}")
    out["model_type"] = model_type
    rope = obj.get("rope_theta")
    if rope is not None and (isinstance(rope, bool) or not isinstance(rope, int | float)):
        raise ValueError(f"rope_theta must be a number or null, got {rope!r:.40}")
    out["rope_theta"] = None if rope is None else float(rope)
    return out
