"""The operator's check of a pool's model source before it creates pods.

A pod whose download step cannot succeed (no such repository or revision, a refused or
missing token, a gated model the token was not granted) would sit in
``Init:CrashLoopBackOff``; checked here first, it becomes a condition and an Event naming
the repository and the reason, and no pods are created for it. The Hub is asked at most
once per :data:`RECHECK_OK_S` for a source that passed, once per
:data:`RECHECK_FAILED_S` for one that failed (so a fixed token is noticed within a
minute), per (URI, endpoint, token).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from flowprefill.contracts.model_uri import ClaimSource, HubSource
from flowprefill.fetch import FetchFailure, check

from ..kube import Kube
from ..models.modelsource import ModelSource
from ..settings import OperatorSettings
from ..status import Problem

log = logging.getLogger(__name__)

RECHECK_OK_S = 600.0
RECHECK_FAILED_S = 60.0

Checker = Callable[..., FetchFailure | None]


@dataclass(frozen=True)
class _Verdict:
    at: float
    failure: FetchFailure | None


class ModelChecks:
    """Remembered Hub checks, per (URI, endpoint, token digest); thread-safe."""

    def __init__(
        self, checker: Checker = check, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._checker = checker
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str, str], _Verdict] = {}

    def hub(
        self, source: HubSource, token: str | None, token_from: str, endpoint: str | None
    ) -> FetchFailure | None:
        digest = hashlib.sha256((token or "").encode()).hexdigest()
        key = (source.uri, endpoint or "", digest)
        now = self._clock()
        with self._lock:
            seen = self._seen.get(key)
        if seen is not None:
            ttl = RECHECK_OK_S if seen.failure is None else RECHECK_FAILED_S
            if now - seen.at < ttl:
                return seen.failure
        failure = self._checker(source, token=token, endpoint=endpoint, token_from=token_from)
        if failure is not None and not failure.permanent:
            # The operator may not reach the Hub where the pods can (egress rules, a
            # mirror only nodes see): say so in the log, let the pods try.
            log.warning("model check of %s inconclusive: %s", source.uri, failure)
            failure = None
        with self._lock:
            self._seen[key] = _Verdict(self._clock(), failure)
        return failure


def read_token(kube: Kube, namespace: str, model: ModelSource) -> tuple[str | None, Problem | None]:
    """The Hub token from the pool's Secret (None without ``tokenSecretRef``), or the
    problem that keeps pods from starting (the Secret or its key missing)."""
    ref = model.token_secret_ref
    if ref is None:
        return None, None
    secret = kube.get("Secret", namespace, ref.name)
    if secret is None:
        return None, Problem(
            "TokenSecretNotFound", f"Secret {ref.name!r} (model.tokenSecretRef) not found",
            blocks_pods=True,
        )  # fmt: skip
    raw = (secret.get("data") or {}).get(ref.key)
    try:
        token = base64.b64decode(raw, validate=True).decode().strip() if raw else ""
    except (binascii.Error, UnicodeDecodeError):
        token = ""
    if not token:
        return None, Problem(
            "TokenSecretNotFound",
            f"Secret {ref.name!r} has no key {ref.key!r} (model.tokenSecretRef.key)",
            blocks_pods=True,
        )
    return token, None


def model_problems(
    kube: Kube,
    namespace: str,
    model: ModelSource,
    settings: OperatorSettings,
    checks: ModelChecks,
) -> list[Problem]:
    """What keeps this model source from reaching the pods: missing claims or token
    Secret, and (``settings.model_check``) what the Hub says about ``hf://`` sources."""
    problems: list[Problem] = []
    claims = {s.claim for s in (model.source, model.tokenizer_source) if isinstance(s, ClaimSource)}
    for claim in sorted(claims):
        if kube.get("PersistentVolumeClaim", namespace, claim) is None:
            problems.append(Problem("ModelVolumeNotFound", f"PVC {claim!r} not found"))
    cache_claim = model.cache.claim_name if model.cache else None
    if cache_claim and kube.get("PersistentVolumeClaim", namespace, cache_claim) is None:
        problems.append(Problem("ModelCacheNotFound", f"PVC {cache_claim!r} not found"))
    hubs = {s for s in (model.source, model.tokenizer_source) if isinstance(s, HubSource)}
    if not hubs:
        return problems
    token, missing = read_token(kube, namespace, model)
    if missing is not None:
        return [*problems, missing]
    if not settings.model_check:
        return problems
    ref = model.token_secret_ref
    token_from = f"Secret {ref.name} key {ref.key}" if ref else ""
    for source in sorted(hubs, key=lambda s: s.uri):
        failure = checks.hub(source, token, token_from, settings.hf_endpoint)
        if failure is not None:
            problems.append(Problem(failure.reason, failure.message, blocks_pods=True))
    return problems
