"""KV hand-off from FlowPrefill's prefill engine into vLLM decode.

- :mod:`~flowprefill.kv.format`: the versioned on-disk layout, writer, lazy reader.
- :mod:`~flowprefill.kv.transport`: where hand-offs live (shared directory, or pulled over
  HTTP from the prefill instance).
- :mod:`~flowprefill.kv.params`: how much of a hand-off decode loads.
- The reference a decode request carries (``HandoffRef``) and the connector config are
  contracts: :mod:`flowprefill.contracts.kv`.
- :mod:`~flowprefill.kv.capture`: producer helpers (HF cache → hand-off).
- :mod:`~flowprefill.kv.paged`: layout arithmetic for the paged cache.
- ``flowprefill.kv.connector``: the vLLM connector class (imports vLLM; not re-exported
  here so this package stays importable without vLLM). See docs/kv.md.
"""

from flowprefill.kv.capture import ReferencePrefill, layers_from_cache, reference_prefill
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
from flowprefill.kv.params import load_end, num_tokens_to_load
from flowprefill.kv.transport import (
    HTTPPullTransport,
    KVTransport,
    SharedDirTransport,
    default_cache_path,
    default_storage_path,
    make_transport,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HTTPPullTransport",
    "KVHandoff",
    "KVHeader",
    "KVReader",
    "KVTransport",
    "ModelFingerprint",
    "ReferencePrefill",
    "SharedDirTransport",
    "build_handoff",
    "check_prompt",
    "default_cache_path",
    "default_storage_path",
    "layers_from_cache",
    "load_end",
    "make_transport",
    "num_tokens_to_load",
    "read_handoff",
    "read_header",
    "reference_prefill",
    "token_ids_digest",
    "write_handoff",
]
