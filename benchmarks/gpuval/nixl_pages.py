"""The NIXL KV hand-off's GPU side (docs/kv.md): what the CPU suite cannot check.

* ``FLASH_ATTN`` pages packed on the GPU equal those packed on the CPU (the layout code is
  device-independent), and equal what vLLM's own ``reshape_and_cache_flash`` kernel writes
  when vLLM is installed in this environment (else skipped, named);
* a producer's buffer in device memory registers with NIXL (``VRAM``) and a second agent
  READs a published block back into host memory byte for byte (UCX's CUDA transports).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import torch

from flowprefill.contracts.nixl import FLASH_ATTENTION


def nixl_page_checks(device: torch.device, dtype: torch.dtype, add: Any) -> None:
    """``add(name, ok, detail)`` per check. Meant for CUDA (gpu_validate skips it
    elsewhere); on CPU it runs the same code on host memory (tests/benchmarks)."""
    from flowprefill.kv.nixl.layout import PageLayout

    heads, dim, block, tokens = 8, 128, 16, 50
    layout = PageLayout(FLASH_ATTENTION, heads, dim, block, dtype)
    key = torch.randn(heads, tokens, dim, dtype=dtype)
    value = torch.randn(heads, tokens, dim, dtype=dtype)
    blocks = layout.num_blocks(tokens)
    on_cpu = torch.zeros(blocks, layout.block_elements, dtype=dtype)
    layout.pack(key, value, on_cpu)
    on_gpu = torch.zeros(blocks, layout.block_elements, dtype=dtype, device=device)
    layout.pack(key.to(device), value.to(device), on_gpu)
    add("FLASH_ATTN pages: GPU pack equals CPU pack", torch.equal(on_gpu.cpu(), on_cpu), "")
    _against_vllm(layout, key, value, on_cpu, device, add)
    _nixl_vram_read(layout, key, value, on_cpu, device, add)


def _against_vllm(
    layout: Any, key: torch.Tensor, value: torch.Tensor, want: torch.Tensor, device: torch.device,
    add: Any,
) -> None:  # fmt: skip
    name = "FLASH_ATTN pages equal vLLM's reshape_and_cache_flash"
    try:
        from vllm._custom_ops import reshape_and_cache_flash
    except Exception as e:  # vLLM is not part of the prefill environment
        add(name, None, f"skipped: vLLM not importable here ({type(e).__name__})")
        return
    heads, dim, n = layout.num_kv_heads, layout.head_dim, layout.block_size
    blocks = want.shape[0]
    cache = torch.zeros(blocks, heads, n, 2 * dim, dtype=want.dtype, device=device)
    key_cache, value_cache = cache.transpose(1, 2).split(dim, dim=-1)  # flash_attn.py's view
    slots = torch.arange(key.shape[1], dtype=torch.long, device=device)
    scale = torch.ones((), dtype=torch.float32, device=device)
    try:
        token_major_key = key.transpose(0, 1).contiguous().to(device)  # [T, H, D]
        token_major_value = value.transpose(0, 1).contiguous().to(device)
        reshape_and_cache_flash(
            token_major_key, token_major_value, key_cache, value_cache, slots, "auto", scale,
            scale,
        )  # fmt: skip
    except (AttributeError, NotImplementedError) as e:  # a CPU build of vLLM
        add(name, None, f"skipped: this vLLM build has no reshape_and_cache_flash ({e})")
        return
    except Exception as e:
        add(name, False, f"{type(e).__name__}: {e}")
        return
    got = cache.reshape(blocks, -1).cpu()
    written = key.shape[1]  # slots past the prompt stay zero on both sides

    def by_token(pages: torch.Tensor) -> torch.Tensor:
        return pages.view(blocks, heads, n, 2 * dim).transpose(1, 2).reshape(-1, heads, 2 * dim)

    ok = torch.equal(by_token(got)[:written], by_token(want)[:written])
    add(name, ok, f"{written} tokens, {blocks} blocks")


def _nixl_vram_read(
    layout: Any, key: torch.Tensor, value: torch.Tensor, want: torch.Tensor, device: torch.device,
    add: Any,
) -> None:  # fmt: skip
    name = "NIXL: VRAM buffer registered, a published block READ back to host"
    try:
        import nixl._api as api

        from flowprefill.kv.nixl.pool import BlockPool
        from flowprefill.kv.nixl.producer import NixlProducer, ServedModel
    except Exception as e:
        add(name, None, f"skipped: nixl not importable ({type(e).__name__})")
        return
    producer = None
    try:
        pool = BlockPool(layout, 1, 64, device)
        served = ServedModel("check", 1, layout.num_kv_heads, layout.head_dim, layout.dtype)
        producer = NixlProducer(served, layout, pool, port=0)
        answer = producer.publish("check", [(key, value)], key.shape[1])
        peer = api.nixl_agent(f"check-{uuid.uuid4()}", api.nixl_agent_config(backends=["UCX"]))
        remote = peer.add_remote_agent(producer.agent_metadata()["agent_metadata"])
        nbytes = layout.block_bytes
        local = torch.zeros(len(answer.block_ids), layout.block_elements, dtype=layout.dtype)
        peer.register_memory(local)
        base = pool.region_addresses()[0]
        remote_descs = peer.get_xfer_descs(
            [(base + b * nbytes, nbytes, pool.buffer.device.index or 0) for b in answer.block_ids],
            "VRAM" if device.type == "cuda" else "DRAM",
        )
        local_descs = peer.get_xfer_descs(
            [(local.data_ptr() + i * nbytes, nbytes, 0) for i in range(len(answer.block_ids))],
            "DRAM",
        )
        handle = peer.initialize_xfer("READ", local_descs, remote_descs, remote)
        t0 = time.perf_counter()
        state = peer.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = peer.check_xfer_state(handle)
        elapsed = time.perf_counter() - t0
        ok = state == "DONE" and torch.equal(local, want)
        add(
            name,
            ok,
            f"{state}, {local.numel() * local.element_size()} bytes in {elapsed * 1e3:.2f} ms",
        )
    except Exception as e:
        add(name, False, f"{type(e).__name__}: {e}")
    finally:
        if producer is not None:
            producer.close()
