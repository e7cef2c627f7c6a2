"""Stage 1 of the pipeline: take in an OpenAI request as a :class:`Job`: its SLO class and
TTFT target, its token ids, its deadline (:func:`intake`).

Checks the model name (404) and the fields sent (a 400 naming one the gateway refuses:
:mod:`flowprefill.gateway.openai_api`), classifies into an SLO class and TTFT target from
what the request asks, tokenizes the prompt or chat (:func:`flowprefill.gateway.tokens.
prompt_token_ids`), and refuses a prompt plus output budget over the context length (400
naming ``max_tokens`` or ``prompt``). Pure but for the tokenizer: no HTTP, no upstream.

What a request asks of its SLO (:func:`slo_request`), read from the conventions its client
may speak:

- ``x-slo-class`` header (ours), the objective header (llm-d's
  ``x-llm-d-inference-objective``, else its deprecated alias, the Gateway API Inference
  Extension's ``x-gateway-inference-objective``), ``slo_class`` body field (ours): a class
  by name, in this order;
- ``x-dynamo-request-priority`` header (NVIDIA Dynamo: higher = more urgent) and vLLM's
  ``priority`` body field (lower = handled earlier, so negated onto our scale): the class
  of nearest priority;
- ``x-llm-d-slo-ttft-ms`` header (llm-d), else its deprecated alias ``x-slo-ttft-ms``:
  the request's own TTFT target.

Where a request sends an llm-d header under both names, the current name wins and the
alias is ignored (not validated either).

Both priority conventions default to 0, so 0 asks for nothing; a value that is not a
number is refused (400 naming the header or field).

The class it gets (:func:`classify`), from the SLO table the operator maintains
(:class:`SLOTableFile`, re-read when it changes):

1. the first class the request names that it may claim;
2. else, when it sent a priority, the class of nearest priority among those it may claim
   (ties: the less urgent);
3. else the first class (table order: most urgent first) whose non-empty rules all match —
   headers (all listed must match), model name, path prefix, API key hash;
4. else the default class.

A client *may claim* a class when the class's claim rule admits it (``anyone``, or its
API key's hash is listed) or when the class is the one steps 3–4 give it anyway: claiming
never escalates past what the operator's rules grant. By default no class admits anyone.

The TTFT target: the class's, unless the request carries its own (``x-llm-d-slo-ttft-ms``
or ``x-slo-ttft-ms``). A
looser one is always honoured (it can only make the request less urgent, so others gain),
a tighter one only when the class's claim rule admits the client and sets a floor
(``min_ttft_slo_ms``; a target below it gets the floor). Every refusal falls back without
failing the request and is reported (:class:`Refusal`, the
``x-flowprefill-slo-class-fallback`` answer header and a counter).

The deadline has one name and one unit from here to the scheduler: the request's
``ttft_slo_s`` (its class's, or its own target where the classifier honoured one) and
``arrival_s``, when the gateway received the request, so
``deadline_s = arrival_s + ttft_slo_s``. A prefill instance is sent ``ttft_slo_s`` and
``elapsed_s`` (:mod:`flowprefill.contracts.prefill_api`) and rebuilds the same deadline
on its clock; every process judges ``met`` as ``ttft_s <= ttft_slo_s`` from that arrival.
The one derived quantity, the TTFT hint for upstreams (the budget left when a call is
sent, under both llm-d names), is computed here (:meth:`Job.upstream_hints`) and nowhere else.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from flowprefill.contracts import SLOTable, SLOTableClass
from flowprefill.contracts import slo as slo_contract
from flowprefill.contracts.deployment import (
    SLO_CLASS_HEADER,
    SLO_OBJECTIVE_HEADERS,
    SLO_PRIORITY_HEADER,
    SLO_TPOT_HEADER,
    SLO_TTFT_HEADERS,
    first_header,
)
from flowprefill.contracts.slo import Fallback
from flowprefill.errors import InvalidRequestError
from flowprefill.gateway.errors import ClientError
from flowprefill.gateway.openai_api import ChatCompletionRequest, CompletionRequest, check_model
from flowprefill.gateway.tokens import Tokenizer, prompt_token_ids

log = logging.getLogger(__name__)

NameSource = Literal["header", "objective", "field"]
MAX_TTFT_SLO_MS = 600_000
"""The longest TTFT target a request may carry: the SLOClass CRD's bound (10 min)."""
_INTEGER = re.compile(r"^[+-]?[0-9]{1,18}$")


@dataclass(frozen=True, slots=True)
class SLORequest:
    names: tuple[tuple[NameSource, str], ...] = ()
    """Class names asked for, in precedence order."""
    priority: int | None = None
    """On the SLO classes' scale (higher = more urgent); None: none asked."""
    priority_sent: str = ""
    """The priority as the client wrote it (for the fallback header)."""
    ttft_slo_ms: float | None = None
    """The request's own TTFT target."""


def _header_int(headers: Mapping[str, str], name: str) -> int | None:
    raw = headers.get(name)
    if raw is None or not raw.strip():
        return None
    if not _INTEGER.match(raw.strip()):
        raise ClientError(400, f"header {name} must be an integer, got {raw[:40]!r}", param=name)
    return int(raw)


def _ttft_ms(headers: Mapping[str, str]) -> float | None:
    sent = first_header(headers, SLO_TTFT_HEADERS)
    if sent is None:
        return None
    name, raw = sent
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 < value <= MAX_TTFT_SLO_MS):
        raise ClientError(
            400,
            f"header {name} must be a number of milliseconds in "
            f"(0, {MAX_TTFT_SLO_MS}], got {raw[:40]!r}",
            param=name,
        )
    return value


def slo_request(
    headers: Mapping[str, str], *, body_class: str | None, body_priority: int | None
) -> SLORequest:
    """``headers`` must be case-insensitive (Starlette's are) or lower-cased."""
    names: list[tuple[NameSource, str]] = []
    objective = first_header(headers, SLO_OBJECTIVE_HEADERS)
    for source, name in (
        ("header", headers.get(SLO_CLASS_HEADER)),
        ("objective", objective[1] if objective else None),
        ("field", body_class),
    ):
        if name:
            names.append((source, name))  # type: ignore[arg-type]
    priority: int | None = None
    sent = ""
    dynamo = _header_int(headers, SLO_PRIORITY_HEADER)
    if dynamo:  # a header wins over the body, as Dynamo's own headers do
        priority, sent = dynamo, f"{SLO_PRIORITY_HEADER}: {dynamo}"
    elif body_priority:
        priority, sent = -body_priority, f"priority {body_priority}"
    return SLORequest(tuple(names), priority, sent, _ttft_ms(headers))


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


class SLOTableFile:
    """The SLO table file, re-read when it changes (ConfigMap updates swap a symlink).

    :meth:`refresh` is cheap (one ``stat``) and is called by the gateway's background
    watcher; a file that fails to parse keeps the last good table and logs why.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self.table = self._read()
        self.num_reloads = 0

    def _stat(self) -> tuple[int, int, int]:
        st = self.path.stat()  # follows symlinks: a swapped ConfigMap target changes inode
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _read(self) -> SLOTable:
        stamp = self._stat()
        try:
            table = SLOTable.model_validate_json(self.path.read_bytes())
        except ValidationError as e:
            raise InvalidRequestError(f"SLO table {self.path} is invalid: {e}") from None
        self._stamp = stamp
        return table

    def refresh(self) -> bool:
        """Reload if the file changed; True when a new table was loaded."""
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return False
            self._stamp = stamp  # a bad file is reported once, not at every refresh
            self.table = self._read()
        except (OSError, InvalidRequestError) as e:
            log.warning("keeping the previous SLO table: %s", e)
            return False
        self.num_reloads += 1
        log.info("reloaded SLO table %s (%d classes)", self.path, len(self.table.classes))
        return True


Kind = Literal["text_completion", "chat.completion"]
"""The OpenAI object a request answers with (also the relay's wire format)."""


@dataclass(eq=False)
class Job:
    """A request the gateway admitted: its class, tokens and deadline. The decode stage
    sets ``num_completion_tokens`` from decode's usage report."""

    request_id: str
    kind: Kind
    body: CompletionRequest | ChatCompletionRequest
    token_ids: list[int]
    classification: Classification
    arrival_s: float
    """When the gateway received the request (the gateway's monotonic clock)."""
    created: int = field(default_factory=lambda: int(time.time()))
    """Unix time, for the OpenAI ``created`` field."""
    num_completion_tokens: int = 1
    """The first token; decode's usage adds the rest."""
    cached_tokens: int | None = None
    """``usage.prompt_tokens_details.cached_tokens``: set only from decode's own report,
    when it is the client's (:mod:`flowprefill.gateway.decode`)."""

    @property
    def slo(self) -> SLOTableClass:
        return self.classification.slo_class

    @property
    def ttft_slo_s(self) -> float:
        """The request's TTFT target: its class's, or its own where honoured."""
        return self.classification.ttft_slo_s

    @property
    def deadline_s(self) -> float:
        return slo_contract.deadline_s(self.arrival_s, self.ttft_slo_s)

    def elapsed_s(self, now_s: float) -> float:
        return max(0.0, now_s - self.arrival_s)

    def met_slo(self, ttft_s: float) -> bool:
        return slo_contract.met_slo(ttft_s, self.ttft_slo_s)

    def upstream_hints(self, now_s: float) -> dict[str, str]:
        """llm-d / Dynamo-style headers for upstreams that understand them: the class and
        the TTFT budget left at ``now_s`` (ms, at least 1) under llm-d's current names and
        their deprecated aliases (an upstream reads whichever it knows), the priority, the
        TPOT target."""
        c = self.classification.slo_class
        entry = _CLASS_HINTS.get(id(c))
        if entry is None or entry[0] is not c:
            entry = _class_hints(c)
        _, objective, after = entry
        deadline_s = slo_contract.deadline_s(self.arrival_s, self.classification.ttft_slo_s)
        budget_ms = str(max(1, round((deadline_s - now_s) * 1e3)))
        headers = objective.copy()
        for name in SLO_TTFT_HEADERS:
            headers[name] = budget_ms
        headers.update(after)
        return headers


_CLASS_HINTS: dict[int, tuple[SLOTableClass, dict[str, str], dict[str, str]]] = {}
"""id(class) -> (the class, its objective headers, its priority and TPOT headers): the
hints that do not change per request, made once per class (classes are frozen; a table
reload makes new ones, whose ids may repeat: the entry holds its class to check)."""


def _class_hints(
    c: SLOTableClass,
) -> tuple[SLOTableClass, dict[str, str], dict[str, str]]:
    if len(_CLASS_HINTS) >= 1024:  # reloaded tables' classes: keep it bounded
        _CLASS_HINTS.clear()
    after = {SLO_PRIORITY_HEADER: str(c.priority)}
    if c.tpot_slo_ms is not None:
        after[SLO_TPOT_HEADER] = str(c.tpot_slo_ms)
    entry = (c, {name: c.name for name in SLO_OBJECTIVE_HEADERS}, after)
    _CLASS_HINTS[id(c)] = entry
    return entry


_IDS = random.Random(os.urandom(32))
"""Request ids' source: seeded from the OS once, reseeded in a forked child (two processes
must not draw the same ids), and private, so nothing that seeds ``random`` for its own
reasons makes ids repeat."""
os.register_at_fork(after_in_child=lambda: _IDS.seed(os.urandom(32)))


def random_uuid_hex() -> str:
    """A random version-4 UUID's 32 hex digits, as ``uuid.uuid4().hex`` writes them (the
    OpenAI-style request id vLLM writes too), without a system call per id: ids must be
    unique, not secret."""
    n = _IDS.getrandbits(128)
    n = (n & ~(0xF000 << 64) & ~(0xC000 << 48)) | (0x4000 << 64) | (0x8000 << 48)
    return f"{n:032x}"


def intake(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    arrival_s: float,
    headers: Mapping[str, str],
    path: str,
    model_name: str,
    table: SLOTable,
    tokenizer: Tokenizer,
) -> Job:
    """``headers`` must be case-insensitive (Starlette's are) or lower-cased. Raises
    :class:`~flowprefill.gateway.errors.ClientError`, or
    :class:`~flowprefill.errors.InvalidRequestError` when no class fits."""
    check_model(body.model, model_name)
    for param, message in body.refusals():
        raise ClientError(400, message, param=param)
    asked = slo_request(headers, body_class=body.slo_class, body_priority=body.priority)
    classification = classify(table, asked, headers=headers, model=body.model, path=path)
    token_ids = prompt_token_ids(body, tokenizer)
    limit = tokenizer.max_model_len
    if len(token_ids) + body.output_budget > limit:
        raise ClientError(
            400,
            f"this model's maximum context length is {limit} tokens; the prompt has "
            f"{len(token_ids)} and max_tokens asks for {body.output_budget} more",
            param="max_tokens" if len(token_ids) < limit else "prompt",
        )
    chat = isinstance(body, ChatCompletionRequest)
    return Job(
        request_id=f"{'chatcmpl' if chat else 'cmpl'}-{random_uuid_hex()}",
        kind="chat.completion" if chat else "text_completion",
        body=body,
        token_ids=token_ids,
        classification=classification,
        arrival_s=arrival_s,
    )
