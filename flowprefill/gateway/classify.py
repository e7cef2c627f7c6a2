"""Which SLO class a request belongs to, and its TTFT target, from the SLO table the
operator maintains and what the request asks (:mod:`flowprefill.gateway.slo_request`).

The class:

1. the first class the request names (``x-slo-class``, ``x-gateway-inference-objective``,
   ``slo_class``) that it may claim;
2. else, when it sent a priority, the class of nearest priority among those it may claim
   (ties: the less urgent);
3. else the first class (table order: most urgent first) whose non-empty rules all match —
   headers (all listed must match), model name, path prefix, API key hash;
4. else the default class.

A client *may claim* a class when the class's claim rule admits it (``anyone``, or its
API key's hash is listed) or when the class is the one steps 3–4 give it anyway: claiming
never escalates past what the operator's rules grant. By default no class admits anyone.

The TTFT target: the class's, unless the request carries its own (``x-slo-ttft-ms``). A
looser one is always honoured (it can only make the request less urgent, so others gain),
a tighter one only when the class's claim rule admits the client and sets a floor
(``min_ttft_slo_ms``; a target below it gets the floor). Every refusal falls back without
failing the request and is reported (:class:`Refusal`, the
``x-flowprefill-slo-class-fallback`` answer header and a counter).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from flowprefill.contracts import SLOTable, SLOTableClass
from flowprefill.contracts.slo import Fallback
from flowprefill.errors import InvalidRequestError
from flowprefill.gateway.slo_request import SLORequest
from flowprefill.gateway.slo_table_file import SLOTableFile

__all__ = ["Classification", "Refusal", "SLOTableFile", "api_key_hash", "classify"]

Source = Literal["header", "objective", "field", "priority", "rule", "default"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """Something the request asked for and did not get."""

    reason: Fallback
    requested: str
    """As the client sent it."""
    slo_class: str | None
    """The class the claim concerned (None: a name the table does not have)."""

    @property
    def claim(self) -> str | None:
        """The ``claim`` label of the refused-claims counter (None: not a refused claim)."""
        return {
            Fallback.CLASS_REFUSED: "class",
            Fallback.PRIORITY_REFUSED: "priority",
            Fallback.TTFT_REFUSED: "ttft",
            Fallback.TTFT_LIMITED: "ttft",
        }.get(self.reason)


@dataclass(frozen=True, slots=True)
class Classification:
    slo_class: SLOTableClass
    source: Source
    requested_ttft_slo_ms: float | None = None
    """The request's own TTFT target where honoured (the floor where limited)."""
    refusals: tuple[Refusal, ...] = ()

    @property
    def ttft_slo_ms(self) -> float:
        """The request's TTFT target: what its deadline is built from and judged against."""
        if self.requested_ttft_slo_ms is not None:
            return self.requested_ttft_slo_ms
        return float(self.slo_class.ttft_slo_ms)

    @property
    def ttft_slo_s(self) -> float:
        return self.ttft_slo_ms / 1e3


def api_key_hash(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    return hashlib.sha256(token.strip().encode()).hexdigest()


def _admits(c: SLOTableClass, key_hash: str | None) -> bool:
    """The class's claim rule admits this client."""
    return c.claim.anyone or (key_hash is not None and key_hash in c.claim.api_key_hashes)


def _by_rules(
    table: SLOTable, headers: Mapping[str, str], model: str | None, path: str, key: str | None
) -> tuple[SLOTableClass | None, Source]:
    for c in table.classes:
        m = c.match
        if not (m.headers or m.models or m.paths or m.api_key_hashes):
            continue
        if m.headers and any(headers.get(k) != v for k, v in m.headers.items()):
            continue
        if m.models and model not in m.models:
            continue
        if m.paths and not any(path.startswith(p) for p in m.paths):
            continue
        if m.api_key_hashes and key not in m.api_key_hashes:
            continue
        return c, "rule"
    if table.default_class is None:
        return None, "default"
    return next(c for c in table.classes if c.name == table.default_class), "default"


def _nearest(classes: Sequence[SLOTableClass], priority: int) -> SLOTableClass:
    """Nearest priority; ties go to the less urgent class (a client never gets more than it
    asked for), then table order."""
    return min(classes, key=lambda c: (abs(c.priority - priority), c.priority))


def _ttft(
    c: SLOTableClass, asked_ms: float | None, key: str | None
) -> tuple[float | None, Refusal | None]:
    if asked_ms is None or asked_ms >= c.ttft_slo_ms:
        return asked_ms, None  # looser (or none): always honoured
    floor = c.claim.min_ttft_slo_ms
    if floor is None or not _admits(c, key):
        return None, Refusal(Fallback.TTFT_REFUSED, f"{asked_ms:g} ms", c.name)
    if asked_ms < floor:
        return float(floor), Refusal(Fallback.TTFT_LIMITED, f"{asked_ms:g} ms", c.name)
    return asked_ms, None


def classify(
    table: SLOTable,
    asked: SLORequest,
    *,
    headers: Mapping[str, str],
    model: str | None,
    path: str,
) -> Classification:
    """``headers`` must be case-insensitive (Starlette's are) or lower-cased. Raises
    :class:`~flowprefill.errors.InvalidRequestError` when no class fits."""
    key = api_key_hash(headers.get("authorization"))
    ruled, rule_source = _by_rules(table, headers, model, path, key)
    by_name = {c.name: c for c in table.classes}
    refusals: list[Refusal] = []
    chosen: tuple[SLOTableClass, Source] | None = None
    for name_source, name in asked.names:
        c = by_name.get(name)
        if c is None:
            refusals.append(Refusal(Fallback.UNKNOWN_CLASS, name, None))
        elif c is ruled or _admits(c, key):
            chosen = (c, name_source)
            break
        else:
            refusals.append(Refusal(Fallback.CLASS_REFUSED, name, c.name))
    if chosen is None and asked.priority is not None:
        claimable = [c for c in table.classes if c is ruled or _admits(c, key)]
        if claimable:
            best = _nearest(claimable, asked.priority)
            wanted = _nearest(table.classes, asked.priority)
            if wanted.priority != best.priority:
                refusals.append(
                    Refusal(Fallback.PRIORITY_REFUSED, asked.priority_sent, wanted.name)
                )
            chosen = (best, "priority")
    if chosen is None:
        if ruled is None:
            unknown = [r.requested for r in refusals if r.reason is Fallback.UNKNOWN_CLASS]
            what = f"unknown SLO class {unknown[0]!r}" if unknown else "no SLO class matches"
            raise InvalidRequestError(f"{what} and the SLO table has no default class")
        chosen = (ruled, rule_source)
    c, source = chosen
    ttft_ms, limited = _ttft(c, asked.ttft_slo_ms, key)
    if limited is not None:
        refusals.append(limited)
    return Classification(c, source, ttft_ms, tuple(refusals))


def fallback_note(classification: Classification) -> str | None:
    """The ``x-flowprefill-slo-class-fallback`` value: each refusal (reason, what was
    asked, ASCII-escaped and cut to 64 characters) and what was used instead."""
    if not classification.refusals:
        return None
    asked = ", ".join(f"{r.reason} {r.requested[:64]!a}" for r in classification.refusals)
    c = classification
    return f"{asked}; used {c.slo_class.name} ({c.ttft_slo_ms:g} ms)"
