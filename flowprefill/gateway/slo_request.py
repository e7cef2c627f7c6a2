"""What a request asks of its SLO, read from the conventions its client may speak.

- ``x-slo-class`` header (ours), ``x-gateway-inference-objective`` header (the Gateway
  API Inference Extension's objective name), ``slo_class`` body field (ours): a class by
  name, in this order;
- ``x-dynamo-request-priority`` header (NVIDIA Dynamo: higher = more urgent) and vLLM's
  ``priority`` body field (lower = handled earlier, so negated onto our scale): the class
  of nearest priority;
- ``x-slo-ttft-ms`` header (llm-d / Inference Extension): the request's own TTFT target.

Both priority conventions default to 0, so 0 asks for nothing. Whether a request gets
what it asks is :mod:`flowprefill.gateway.classify`'s decision; this module only parses,
and refuses (400 naming the header or field) a value that is not a number.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from flowprefill.contracts.deployment import (
    SLO_CLASS_HEADER,
    SLO_OBJECTIVE_HEADER,
    SLO_PRIORITY_HEADER,
    SLO_TTFT_HEADER,
)
from flowprefill.gateway.errors import ClientError

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
    raw = headers.get(SLO_TTFT_HEADER)
    if raw is None or not raw.strip():
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 < value <= MAX_TTFT_SLO_MS):
        raise ClientError(
            400,
            f"header {SLO_TTFT_HEADER} must be a number of milliseconds in "
            f"(0, {MAX_TTFT_SLO_MS}], got {raw[:40]!r}",
            param=SLO_TTFT_HEADER,
        )
    return value


def slo_request(
    headers: Mapping[str, str], *, body_class: str | None, body_priority: int | None
) -> SLORequest:
    """``headers`` must be case-insensitive (Starlette's are) or lower-cased."""
    names: list[tuple[NameSource, str]] = []
    for source, name in (
        ("header", headers.get(SLO_CLASS_HEADER)),
        ("objective", headers.get(SLO_OBJECTIVE_HEADER)),
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
