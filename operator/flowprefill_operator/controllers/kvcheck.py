"""Pure: whether the pools of a service can hand KV off to each other, before pods start.

Each pool renders its own pods, so what the two roles must agree on is checked across the
service's pools here: the transport (and claim) in effect (:func:`kv_mismatch`), and with
``nixl`` what vLLM's consumer checks in its handshake or cannot read
(:func:`nixl_problems`).
"""

from __future__ import annotations

from flowprefill.contracts.nixl import check_decode_tp
from flowprefill.errors import KVHandoffError

from ..builders.common import PoolRef
from ..builders.nixl import served_model, uses_nixl
from ..status import Problem

MISMATCH = "KVHandoffMismatch"
NIXL_TP_REFUSED = "NixlTensorParallelRefused"


def _others(pool: PoolRef, peers: list[PoolRef]) -> list[PoolRef]:
    """The service's pools of the other role: those whose prefill hands KV to this pool's
    decode or whose decode takes it from this pool's prefill (a colocated pool runs both,
    and the gateway pairs prefill and decode across pools and pods)."""
    me = pool.spec
    return [
        p
        for p in peers
        if p.name != pool.name
        and ((me.runs_prefill and p.spec.runs_decode) or (me.runs_decode and p.spec.runs_prefill))
    ]


def describe(p: PoolRef) -> str:
    """A pool's hand-off as a status message names it."""
    kv = p.spec.kv
    if kv is None:
        return "no kvHandoff"
    text = f"kvHandoff {kv.transport}" + (f" ({kv.claim_name})" if kv.claim_name else "")
    return text + (" (unset: the default on GPUs)" if p.spec.kv_handoff is None else "")


def _key(p: PoolRef) -> tuple[str, str | None] | None:
    kv = p.spec.kv
    return (str(kv.transport), kv.claim_name) if kv else None


def kv_mismatch(pool: PoolRef, peers: list[PoolRef]) -> list[Problem]:
    """The service's pools of the other role must hand KV off the same way (the transport
    in effect, and the claim), or decode silently recomputes every prompt (the hand-off
    never arrives)."""
    others = [p for p in _others(pool, peers) if _key(p) != _key(pool)]
    if not others:
        return []
    theirs = ", ".join(f"{p.spec.role} pool {p.name!r} has {describe(p)}" for p in others)
    return [Problem(MISMATCH, f"this pool has {describe(pool)} but {theirs}")]


def _pair(pool: PoolRef, other: PoolRef) -> tuple[PoolRef, PoolRef]:
    """(prefill side, decode side) of two pools :func:`_others` pairs; a colocated pool is
    the decode side next to a prefill pool, else the prefill side."""
    if pool.spec.role == "decode" or other.spec.role == "prefill":
        return other, pool
    return pool, other


def nixl_problems(pool: PoolRef, peers: list[PoolRef]) -> list[Problem]:
    """With nixl on both sides, per pool of the other role:

    * decode's tensor-parallel degree must be 1 or prefill's
      (:func:`flowprefill.contracts.nixl.check_decode_tp`): refused before any pod starts
      (``blocks_pods``), naming ``engine.tpSize`` and ``vllm.tensorParallelSize``;
    * the block size, decode's ``--model`` string (prefill's ``served_model``) and the
      device kind (GPU or CPU: the attention backend's page layout) must be equal, or
      vLLM's handshake refuses prefill and decode recomputes every prompt.
    """
    if not uses_nixl(pool.spec):
        return []
    problems: list[Problem] = []
    # A colocated pool also hands off to itself: its own vLLM reads its own engine's KV.
    own = [pool] if pool.spec.role == "colocated" else []
    for other in [*own, *_others(pool, peers)]:
        if not uses_nixl(other.spec):
            continue  # kv_mismatch says so
        prefill, decode = _pair(pool, other)
        p_tp, d_tp = prefill.spec.prefill_tp_size, decode.spec.decode_tp_size
        try:
            check_decode_tp(p_tp, d_tp)
        except KVHandoffError as e:
            problems.append(
                Problem(
                    NIXL_TP_REFUSED,
                    f"decode pool {decode.name!r} vllm.tensorParallelSize={d_tp} and prefill "
                    f"pool {prefill.name!r} engine.tpSize={p_tp}: {e}",
                    blocks_pods=True,
                )
            )
        differ = []
        if prefill.spec.nixl_block_size != decode.spec.nixl_block_size:
            differ.append(
                f"kvHandoff.nixl.blockSize (prefill {prefill.spec.nixl_block_size}, "
                f"decode {decode.spec.nixl_block_size})"
            )
        if served_model(prefill.spec) != served_model(decode.spec):
            differ.append(
                f"the model's path (prefill serves {served_model(prefill.spec)!r}, decode "
                f"--model {served_model(decode.spec)!r})"
            )
        if prefill.spec.on_gpu != decode.spec.on_gpu:
            differ.append(
                "GPU or CPU (prefill on "
                + ("GPUs" if prefill.spec.on_gpu else "CPU")
                + ", decode on "
                + ("GPUs" if decode.spec.on_gpu else "CPU")
                + ")"
            )
        if differ:
            problems.append(
                Problem(
                    MISMATCH,
                    f"nixl from prefill pool {prefill.name!r} to decode pool {decode.name!r}: "
                    + "; ".join(differ)
                    + " differ, so vLLM's NIXL handshake refuses prefill and decode "
                    "recomputes every prompt",
                )
            )
    return problems
