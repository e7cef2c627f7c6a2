"""Typed errors a caller can cause; each maps to a clear message (and, over HTTP, a 4xx)."""

from __future__ import annotations


class FlowPrefillError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidRequestError(FlowPrefillError, ValueError):
    """A request that can never be served as given (empty prompt, too long, bad SLO)."""


class UnknownNameError(FlowPrefillError, ValueError):
    """A policy, granularity, model family or other name that is not registered."""

    def __init__(self, what: str, name: str, known: list[str] | tuple[str, ...]) -> None:
        self.what = what
        self.name = name
        self.known = tuple(known)
        super().__init__(f"unknown {what} {name!r}; expected one of: {', '.join(self.known)}")

    def __reduce__(self) -> tuple[type[UnknownNameError], tuple[str, str, tuple[str, ...]]]:
        # Picklable, so a worker process can raise it back to a multiprocessing pool.
        return (type(self), (self.what, self.name, self.known))


class UnknownTaskError(FlowPrefillError, KeyError):
    """A command named a task the execution pool does not hold."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown task"


class TaskCancelledError(FlowPrefillError):
    """Raised inside a running task when it was cancelled (client gone, engine draining)."""


class EngineClosedError(FlowPrefillError, RuntimeError):
    """The engine is shutting down and accepts no new requests."""


class RankFailedError(EngineClosedError):
    """A tensor-parallel rank of this instance died or stopped answering: the instance is
    down (servers answer 503 and exit, so the pod restarts)."""


# ------------------------------------------------------------- KV hand-off


class KVHandoffError(FlowPrefillError):
    """Base class: a KV hand-off could not be written, found, read or used."""


class KVBudgetExceededError(KVHandoffError):
    """The KV a prefill instance holds for decode is at its budget: this prompt gets no
    hand-off, and decode recomputes it (docs/kv.md, "KV budget")."""


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
