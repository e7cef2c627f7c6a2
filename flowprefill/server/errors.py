"""Re-exports :mod:`flowprefill.web.errors` for importers that predate it (``serve-prefill``'s
CLI, test helpers, benchmarks); new code imports :mod:`flowprefill.web.errors`."""

from flowprefill.web.errors import (
    ERROR_TYPES,
    BodySizeLimit,
    error_body,
    error_response,
    install_error_handlers,
)

__all__ = ["ERROR_TYPES", "BodySizeLimit", "error_body", "error_response", "install_error_handlers"]
