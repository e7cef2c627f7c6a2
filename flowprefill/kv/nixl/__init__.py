"""The KV hand-off to stock vLLM decode over NIXL (docs/kv.md).

- :mod:`~flowprefill.kv.nixl.layout`: a block's bytes in the consumer's attention backend.
- :mod:`~flowprefill.kv.nixl.pool`: the registered paged buffer and its block allocator.
- :mod:`~flowprefill.kv.nixl.leases`: which prompts hold blocks, until read or expired.
- :mod:`~flowprefill.kv.nixl.side_channel`: the handshake a consumer starts with.
- :mod:`~flowprefill.kv.nixl.producer`: the NIXL agent tying them together.

The wire contract (versions, hash, ``kv_transfer_params``) is
:mod:`flowprefill.contracts.nixl`'s.
"""
