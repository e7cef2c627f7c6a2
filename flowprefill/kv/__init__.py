"""KV hand-off from FlowPrefill's prefill engine into vLLM decode.

- :mod:`~flowprefill.kv.format`: the versioned on-disk layout, writer, lazy reader.
- :mod:`~flowprefill.kv.transport`: where hand-offs live (shared directory, or pulled over
  HTTP from the prefill instance).
- :mod:`~flowprefill.kv.params`: the ``kv_transfer_params`` a decode request carries.
- :mod:`~flowprefill.kv.capture`: producer helpers (HF cache → hand-off).
- :mod:`~flowprefill.kv.paged`: layout arithmetic for the paged cache.
- ``flowprefill.kv.connector``: the vLLM connector class (imports vLLM; not re-exported
  here so this package stays importable without vLLM). See docs/kv.md.
"""

from flowprefill.kv.capture import PrefillResult, layers_from_cache, reference_prefill
from flowprefill.kv.errors import KVFormatError, KVHandoffError, KVMismatchError, KVNotFoundError
from flowprefill.kv.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    KVHandoff,
    KVHeader,
    KVReader,
    ModelFingerprint,
    build_handoff,
    check_prompt,
    read_handoff,
    read_header,
    token_ids_digest,
    write_handoff,
)
from flowprefill.kv.params import HandoffRef, load_end, num_tokens_to_load, result_params
from flowprefill.kv.transport import (
    HTTPPullTransport,
    KVTransport,
    SharedDirTransport,
    default_cache_path,
    default_storage_path,
    make_transport,
)

CONNECTOR_MODULE = "flowprefill.kv.connector"
CONNECTOR_CLASS = "FlowPrefillConnector"


def kv_transfer_config(
    storage_path: str | None = None, *, transport: str = "shared_dir", **extra: object
) -> dict[str, object]:
    """The ``--kv-transfer-config`` / ``LLM(kv_transfer_config=...)`` value for decode.

    ``storage_path`` is the shared directory (``shared_dir``) or decode's local cache
    directory (``http``). ``extra`` goes to ``kv_connector_extra_config`` (e.g.
    ``delete_after_load=False``, ``timeout_s=2``).
    """
    if transport == "http":
        where: dict[str, object] = {
            "transport": "http",
            "cache_dir": storage_path or default_cache_path(),
        }
    elif transport == "shared_dir":
        where = {"shared_storage_path": storage_path or default_storage_path()}
    else:
        raise KVHandoffError(f"unknown KV transport {transport!r}; expected shared_dir or http")
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_consumer",
        # A hand-off that fails while loading (truncated download, file swept) must mean
        # "recompute those blocks", never a failed request (vLLM's default is "fail").
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {**where, **extra},
    }


__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HTTPPullTransport",
    "HandoffRef",
    "KVFormatError",
    "KVHandoff",
    "KVHandoffError",
    "KVHeader",
    "KVMismatchError",
    "KVNotFoundError",
    "KVReader",
    "KVTransport",
    "ModelFingerprint",
    "PrefillResult",
    "SharedDirTransport",
    "build_handoff",
    "check_prompt",
    "default_cache_path",
    "default_storage_path",
    "kv_transfer_config",
    "layers_from_cache",
    "load_end",
    "make_transport",
    "num_tokens_to_load",
    "read_handoff",
    "read_header",
    "reference_prefill",
    "result_params",
    "token_ids_digest",
    "write_handoff",
]
