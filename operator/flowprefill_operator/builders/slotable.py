"""Pure: the SLOClasses of a namespace -> acceptance verdicts and each gateway's SLO table."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from flowprefill.contracts.deployment import SLO_CLASS_HEADER, SLO_OBJECTIVE_HEADERS
from flowprefill.contracts.slo import SLOTableClaim

from ..models import LabelSelector, SLOClassSpec, SLOTable, SLOTableClass, SLOTableMatch
from ..models.sloclass import SecretRef


@dataclass(frozen=True)
class SLOClassView:
    """An SLOClass as read from the API: identity, labels and the parsed spec (or why not)."""

    name: str
    labels: Mapping[str, str]
    created: str  # creationTimestamp; the oldest default wins
    generation: int | None
    spec: SLOClassSpec | None
    error: str | None = None


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: str
    message: str


def sha256_hex(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def judge_classes(
    classes: Iterable[SLOClassView], secret_keys: Mapping[str, list[str] | None]
) -> dict[str, Verdict]:
    """Acceptance of every class in one namespace.

    ``secret_keys`` maps a referenced Secret's name (match or claim rules) to its API-key
    hashes (None: not found).
    """
    verdicts: dict[str, Verdict] = {}
    default_owner: str | None = None
    for view in sorted(classes, key=lambda v: (v.created, v.name)):
        spec = view.spec
        if spec is None:
            verdicts[view.name] = Verdict(False, "InvalidSpec", view.error or "invalid spec")
            continue
        missing = [name for name in spec.secret_names() if secret_keys.get(name) is None]
        if missing:
            verdicts[view.name] = Verdict(
                False,
                "SecretNotFound",
                f"Secret {missing[0]!r} not found; its API keys match and claim nothing",
            )
            continue
        if spec.default and default_owner is not None:
            verdicts[view.name] = Verdict(
                False,
                "DuplicateDefault",
                f"{default_owner!r} is already the default class; this one serves as non-default",
            )
            continue
        if spec.default:
            default_owner = view.name
        verdicts[view.name] = Verdict(True, "Accepted", _acceptance_message(spec))
    return verdicts


def _acceptance_message(spec: SLOClassSpec) -> str:
    """ "in use", with a warning for a header rule on a claim header: a ``match`` rule on
    ``x-slo-class`` lets every client that sends the header in; ``claim`` is what admits."""
    claim_headers = {SLO_CLASS_HEADER, *SLO_OBJECTIVE_HEADERS}
    ruled = sorted(h.name for h in spec.match.headers if h.name in claim_headers)
    if ruled:
        return (
            f"in use; match.headers on {ruled[0]} admits every client that sends it "
            "(a claim anyone may make): use spec.claim to say who may"
        )
    return "in use"


def _hashes(
    inline: list[str], ref: SecretRef | None, secret_keys: Mapping[str, list[str] | None]
) -> list[str]:
    hashes = list(inline)
    if ref is not None:
        hashes += secret_keys.get(ref.name) or []
    return sorted(set(hashes))


def selected(view: SLOClassView, selectors: Iterable[LabelSelector | None]) -> bool:
    """Whether any pool of a service selects the class (an unset selector selects all)."""
    return any(s is None or s.matches(dict(view.labels)) for s in selectors)


def build_slo_table(
    classes: Iterable[SLOClassView],
    selectors: Iterable[LabelSelector | None],
    verdicts: Mapping[str, Verdict],
    secret_keys: Mapping[str, list[str] | None],
) -> SLOTable:
    """The table one service's gateway reads, most urgent class first."""
    selectors = list(selectors)
    rows: list[SLOTableClass] = []
    default_class: str | None = None
    for view in classes:
        spec = view.spec
        if spec is None or not selected(view, selectors):
            continue
        verdict = verdicts.get(view.name)
        if spec.default and verdict is not None and verdict.accepted:
            default_class = view.name
        match, claim = spec.match, spec.claim
        rows.append(
            SLOTableClass(
                name=view.name,
                task_type=spec.task_type,
                ttft_slo_ms=spec.ttft_slo_ms,
                tpot_slo_ms=spec.tpot_slo_ms,
                priority=spec.priority,
                attainment_target=spec.attainment_target,
                match=SLOTableMatch(
                    headers={h.name: h.value for h in match.headers},
                    models=list(match.models),
                    paths=list(match.paths),
                    api_key_hashes=_hashes(
                        match.api_key_hashes, match.api_key_secret_ref, secret_keys
                    ),
                ),
                claim=SLOTableClaim(
                    anyone=claim.anyone,
                    api_key_hashes=_hashes(
                        claim.api_key_hashes, claim.api_key_secret_ref, secret_keys
                    ),
                    min_ttft_slo_ms=claim.min_ttft_slo_ms,
                ),
            )
        )
    rows.sort(key=lambda row: (-row.priority, row.name))
    return SLOTable(default_class=default_class, classes=rows)
