"""What every controller shares: the process-wide context kept in kopf's memo, per-key
locks, Events as data, status parsing, and the mapping of API errors to kopf retries.

State lives in the operator-level ``kopf.Memo`` filled by the startup handler. kopf gives
every object a *shallow copy* of that memo, so controllers only ever mutate the objects
stored there (never assign new memo keys in a handler): the copies share them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import kopf
from pydantic import BaseModel, ValidationError

from .. import GROUP, VERSION
from ..kube import ApiError, Kube, NotOwned
from ..settings import OperatorSettings
from ..status import Problem
from .modelcheck import ModelChecks

POOLS = (GROUP, VERSION, "servingpools")
CLASSES = (GROUP, VERSION, "sloclasses")
# Read once at import: kopf needs the timer intervals when the handlers are registered.
SETTINGS = OperatorSettings.from_env()

Body = dict[str, Any]
T = TypeVar("T")


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post about an object (controllers return them as data)."""

    type: str  # Normal | Warning
    reason: str
    message: str


class KeyedLocks:
    """One lock per key: a timer and a watch handler never work on one thing at once
    (kopf runs sync handlers in a thread pool, timers beside the event handlers)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[tuple[str, ...], threading.Lock] = {}

    @contextmanager
    def __call__(self, *key: str) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            yield


@dataclass(frozen=True)
class Context:
    """The API client, the settings, the locks and the remembered model checks, created
    once at startup."""

    kube: Kube
    settings: OperatorSettings
    locks: KeyedLocks
    model_checks: ModelChecks = field(default_factory=ModelChecks)


@dataclass
class Health:
    """What the liveness probe reports: when the operator started and last reconciled."""

    started: str
    last_reconcile: str = ""
    handled: bool = False
    """A pool handler or timer ran in this process (kopf then holds its finalizer on the
    pools); a peering standby that never took over stays False."""

    def reconciled(self) -> None:
        self.last_reconcile = now_rfc3339()


def from_memo(memo: kopf.Memo, key: str, kind: type[T]) -> T:
    """The object the startup handler stored under ``key`` (typed)."""
    value = memo.get(key)
    if not isinstance(value, kind):
        raise kopf.TemporaryError(f"operator state {key!r} not initialised yet", delay=1)
    return value


def context(memo: kopf.Memo) -> Context:
    return from_memo(memo, "context", Context)


def health(memo: kopf.Memo) -> Health:
    return from_memo(memo, "health", Health)


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def validation_message(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        parts.append(f"spec.{loc}: {e['msg']}" if loc else f"spec: {e['msg']}")
    return "; ".join(parts)


def parse_status(model: type[BaseModel], raw: dict[str, Any] | None) -> Any:
    """Previous status, ignoring fields this version does not know (or garbled ones)."""
    known = {f.alias or n for n, f in model.model_fields.items()}
    try:
        return model.model_validate({k: v for k, v in (raw or {}).items() if k in known})
    except ValidationError:
        return model()


def post(body: Any, events: Iterable[Event]) -> None:
    """Post Events about ``body`` (anything with apiVersion, kind and metadata)."""
    for e in events:
        kopf.event(body, type=e.type, reason=e.reason, message=e.message[:1024])


APPLY_REASONS = {403: "Forbidden", 422: "Invalid"}
"""Degraded reasons of a child the API server refused (any other refusal: ApplyFailed)."""


def apply_children(kube: Kube, manifests: Iterable[dict[str, Any]]) -> list[Problem]:
    """Apply every manifest; what could not be written becomes a :class:`Problem` naming the
    object (kind namespace/name) and the API error, marked ``not_applied``: 403 Forbidden,
    422 Invalid, any other refusal ApplyFailed, a same-named object the operator did not
    make NotOwned (left as it is). The others are still applied. Transient errors (5xx,
    429, timeouts) raise :class:`ApiError`: the caller retries the whole reconcile."""
    problems: list[Problem] = []
    for manifest in manifests:
        meta = manifest["metadata"]
        what = f"{manifest['kind']} {meta.get('namespace')}/{meta['name']}"
        try:
            kube.apply(manifest)
        except NotOwned as e:
            problems.append(Problem("NotOwned", str(e), not_applied=True))
        except ApiError as e:
            if e.transient:
                raise
            reason = APPLY_REASONS.get(e.status, "ApplyFailed")
            problems.append(Problem(reason, f"{what}: {e}", not_applied=True))
    return problems


def retrying(retry: int, fn: Callable[[], T]) -> T:
    """Run one API-bound step; API errors become kopf retries with growing delays."""
    try:
        return fn()
    except ApiError as e:
        delay = min(2 ** min(retry, 6), 60) if e.transient else 60
        raise kopf.TemporaryError(f"Kubernetes API: {e}", delay=delay) from e
