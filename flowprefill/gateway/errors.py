"""What can go wrong with a request in the gateway, and the one mapping from a failure to
the status the client gets and the ``reason`` label of ``flowprefill_gateway_errors``.

- :class:`ClientError`: the request itself is wrong (unknown model, too long). A 4xx with
  the offending field; not counted as a gateway error.
- :class:`UpstreamError`: a prefill or decode instance failed, refused, timed out or
  answered 4xx (passed through); ``reason`` is ``<role>_<what>``.
- :class:`NoHealthyInstanceError`: every instance of a pool is backing off (503).
- :class:`~flowprefill.web.disconnect.ClientDisconnected`: the client left (499).
"""

from __future__ import annotations

from flowprefill.web.disconnect import ClientDisconnected


class GatewayError(Exception):
    """A request the gateway could not serve: answered ``status``, counted under ``reason``."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class UpstreamError(GatewayError):
    def __init__(self, status: int, message: str, reason: str, retryable: bool = False) -> None:
        super().__init__(status, message, reason)
        self.retryable = retryable
        """True only when nothing was processed (connection refused): safe to try elsewhere."""


class NoHealthyInstanceError(GatewayError):
    """Every instance of a pool is out of rotation."""

    def __init__(self, role: str) -> None:
        super().__init__(503, f"no healthy {role} instance", f"no_{role}_instance")


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
