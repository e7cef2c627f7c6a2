"""What can go wrong with a request in the gateway, and the one mapping from a failure to
the status the client gets and the ``reason`` label of ``flowprefill_gateway_errors``.

- :class:`ClientError`: the request itself is wrong (unknown model, too long). A 4xx with
  the offending field; not counted as a gateway error.
- :class:`UpstreamError`: a prefill or decode instance failed, refused, timed out or
  answered 4xx (passed through); ``reason`` is ``<role>_<what>``.
- :class:`NoHealthyInstanceError`: every instance of a pool is backing off (503).
- :class:`ShedError`: a sheddable class's request no instance can serve before its
  deadline (429 with ``Retry-After``; :mod:`flowprefill.gateway.admission`).
- :class:`OverloadError`: any request that would wait past its useful time, or finds the
  gateway's queue full (503 with ``Retry-After``; docs/gateway.md, "Overload").
- :class:`~flowprefill.web.disconnect.ClientDisconnected`: the client left (499).
"""

from __future__ import annotations

import math

from flowprefill.contracts.metrics import OverloadReason
from flowprefill.web.disconnect import ClientDisconnected


class GatewayError(Exception):
    """A request the gateway could not serve: answered ``status``, counted under ``reason``."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.type_: str | None = None
        """The OpenAI error ``type`` (None: the status's usual one)."""
        self.headers: dict[str, str] = {}
        """Headers the error answer carries (``Retry-After``)."""


class UpstreamError(GatewayError):
    def __init__(
        self,
        status: int,
        message: str,
        reason: str,
        retryable: bool = False,
        *,
        connection_lost: bool = False,
    ) -> None:
        super().__init__(status, message, reason)
        self.retryable = retryable
        """True only when nothing was processed (connection refused): safe to try elsewhere."""
        self.connection_lost = connection_lost
        """The instance broke the connection (died) or stalled instead of answering with an
        HTTP error: safe to try elsewhere if nothing had been received from it."""


class NoHealthyInstanceError(GatewayError):
    """Every instance of a pool is out of rotation."""

    def __init__(self, role: str) -> None:
        super().__init__(503, f"no healthy {role} instance", f"no_{role}_instance")


SHED_REASON = "shed"


class ShedError(GatewayError):
    """Refused at arrival: the request's class is sheddable and no prefill instance is
    predicted to produce its first token before its deadline. Nothing was sent upstream."""

    def __init__(
        self, slo_class: str, *, ttft_slo_s: float, best_finish_in_s: float, retry_after_s: float
    ) -> None:
        super().__init__(
            429,
            f"SLO class {slo_class!r} is sheddable and cannot be served within its "
            f"{ttft_slo_s * 1e3:.0f} ms TTFT target now: the earliest predicted first token "
            f"is {best_finish_in_s:.2f} s away; retry after {retry_after_s:.0f} s",
            SHED_REASON,
        )
        self.slo_class = slo_class
        self.retry_after_s = retry_after_s
        self.type_ = "rate_limit_exceeded"
        self.headers = {"retry-after": str(max(1, round(retry_after_s)))}


class OverloadError(GatewayError):
    """Answered 503 with ``Retry-After`` instead of waiting: its first token is predicted
    (``too_late``) or turned out (``expired``) later than its deadline plus its useful
    wait, or the gateway already holds its most waiting requests (``queue_full``). Counted
    under ``reason`` (:class:`~flowprefill.contracts.metrics.OverloadReason`), in
    ``flowprefill_gateway_errors`` and per class in ``flowprefill_gateway_overload_refused``."""

    def __init__(
        self, slo_class: str, reason: OverloadReason, detail: str, *, retry_after_s: float
    ) -> None:
        retry = max(1, math.ceil(retry_after_s))
        super().__init__(
            503,
            f"overloaded ({reason}): SLO class {slo_class!r} request {detail}; "
            f"retry after {retry} s",
            str(reason),
        )
        self.slo_class = slo_class
        self.retry_after_s = float(retry)
        self.type_ = "service_unavailable"
        self.headers = {"retry-after": str(retry)}


class ClientError(Exception):
    """A request that can never be served as sent (4xx naming ``param``)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, type_: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.type_ = type_


def as_gateway_error(exc: GatewayError | ClientDisconnected) -> GatewayError:
    """The status and reason a failed request is answered and counted with."""
    if isinstance(exc, ClientDisconnected):
        return GatewayError(499, "client disconnected", "client_disconnected")
    return exc
