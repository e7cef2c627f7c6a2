"""Typed errors of the KV hand-off; each message names what mismatched."""

from __future__ import annotations

from flowprefill.errors import FlowPrefillError


class KVHandoffError(FlowPrefillError):
    """Base class: a KV hand-off could not be written, found, read or used."""


class KVNotFoundError(KVHandoffError, LookupError):
    """No hand-off is stored under the given id (never written, expired or consumed)."""


class KVFormatError(KVHandoffError, ValueError):
    """The stored bytes are not a valid hand-off: truncated, corrupted, wrong version."""


class KVMismatchError(KVHandoffError, ValueError):
    """A valid hand-off that does not fit its use: another model's shape, other tokens."""

    def __init__(self, field: str, expected: object, found: object, detail: str = "") -> None:
        self.field = field
        self.expected = expected
        self.found = found
        suffix = f" ({detail})" if detail else ""
        super().__init__(
            f"KV hand-off {field} mismatch: expected {expected!r}, found {found!r}{suffix}"
        )
