"""The KV hand-off from prefill to decode, and the gap to the second token.

In a disaggregated deployment the first token comes from the prefill instance; the second
comes from a decode instance, which first needs the prompt's KV cache. The gap between the
two is modelled as

    first_gap_s = handoff_s(n) + decode_step_s(n + 1)

* ``handoff_s``: with tensor parallelism and ``gather_to_rank0`` (today's path,
  flowprefill/prefill/tp/ranks.py ``gather_kv_heads``), the ranks' heads are first gathered
  to rank 0 over NVLink; then the transport's fixed per-transfer latency, a staging write
  where the transport has one (``file+http``: the safetensors file), and the bytes over
  the transport's *effective* bandwidth. Without the gather (NIXL), every rank sends its
  own heads at once: on a link per GPU (RDMA NIC per GPU, NVLink) the rates add up; on a
  shared NIC (TCP) they do not.
* ``decode_step_s``: one memory-bound decode step at batch size one — the per-pass
  overhead of the prefill cost model, every weight read once (per GPU: ``1/TP`` of them)
  plus the request's own KV, at :data:`DECODE_HBM_EFFICIENCY` of the GPU's datasheet HBM
  bandwidth, and two all-reduce latencies per layer with TP > 1.

Both are linear in the prompt length ``n``; :class:`SecondTokenModel` keeps the two
coefficients. Assumptions, stated once: the decode pool is unsaturated (the simulator has
no decode queues: a request's decode starts the moment its KV lands, and its step is not
slowed by other requests' KV reads), decode runs at the prefill's TP degree on the same
GPU type, and the hand-off never delays prefill (the engine writes the file in a thread
after the first token, flowprefill/prefill/server/prefill.py). Line rates are upper bounds;
every effective figure below says what fraction of the line it assumes and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flowprefill.contracts.slo import PAPER_TBT_SLOS_S
from flowprefill.errors import InvalidRequestError, UnknownNameError
from flowprefill.lab.sim.cost import ALLREDUCE_LATENCY_S, PASS_OVERHEAD_S
from flowprefill.lab.sim.hardware import GPUSpec, ModelShape, get_gpu, get_model
from flowprefill.prefill.request import RequestState

if TYPE_CHECKING:
    from flowprefill.lab.sim.driver import SimResult

GB = 1e9

DECODE_HBM_EFFICIENCY = 0.8
"""Fraction of datasheet HBM bandwidth a decode step's weight and KV reads reach. An
assumption: memory-bound GEMV kernels are commonly reported at 70–90 % of the datasheet
figure; nothing was measured on a GPU here."""
NVLINK_EFFICIENCY = 0.8
"""Fraction of the per-direction NVLink rate a bulk copy reaches (the ``nvlink`` transport
and the TP gather to rank 0). An assumption: point-to-point copies measure below the link
rate; 80 % is a round figure, not a measurement."""
NIXL_REQUEST_S = 2e-3
"""Per-request fixed cost of a NIXL read: the decode engine learns of the request, posts
the read, polls for completion between engine steps, notifies the producer. Assumed (no
GPU measurement here); on this CPU machine a 5-block NIXL pull took 2.1 ms in all
(../shared/notes/nixl.md)."""
FILE_HTTP_REQUEST_S = 5e-3
"""Per-request fixed cost of today's path: temp file create + rename on the prefill side,
the header's range request from decode's scheduler and the body's GET (two HTTP round
trips through Python), file opens. Assumed, of the order a Python HTTP request costs."""
FILE_STAGING_BYTES_PER_S = 1.5 * GB
"""The write before the send: CRC-32 over the tensor bytes (``build_handoff``; zlib 3.4–3.6
GB/s) then safetensors ``save_file`` (2.1–3.3 GB/s warm, 0.55 into cold pages), both
measured on this 2-core machine for 64–512 MiB of bf16; one after the other ≈ 1.5 GB/s.
The GPU→host copy before them (PCIe, tens of GB/s) is not counted."""


@dataclass(frozen=True, slots=True)
class Transport:
    """How KV bytes get from a prefill GPU to a decode GPU.

    ``bandwidth_bytes_per_s`` is the *effective* rate of one sender, never above
    ``line_rate_bytes_per_s`` (None where the figure is a measurement of the whole path);
    ``latency_s`` is paid once per transfer; ``staging_bytes_per_s`` (None: none) is a
    write every byte goes through before it is sent. ``per_rank``: each TP rank can send
    its own heads (NIXL); ``link_per_gpu``: each GPU has its own link, so per-rank sends
    add up (else they share one). ``source`` cites every figure."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    source: str
    line_rate_bytes_per_s: float | None = None
    staging_bytes_per_s: float | None = None
    per_rank: bool = True
    link_per_gpu: bool = False

    def __post_init__(self) -> None:
        line = self.line_rate_bytes_per_s
        if not self.bandwidth_bytes_per_s > 0 or self.latency_s < 0:
            raise ValueError(f"transport {self.name}: bandwidth must be > 0, latency ≥ 0")
        if line is not None and self.bandwidth_bytes_per_s > line:
            raise ValueError(f"transport {self.name}: effective rate above the line rate")

    @property
    def efficiency(self) -> float | None:
        """Effective / line rate (None for a measured path)."""
        if self.line_rate_bytes_per_s is None:
            return None
        return self.bandwidth_bytes_per_s / self.line_rate_bytes_per_s


def _link(
    name: str, line: float, efficiency: float, wire_s: float, why: str, *, per_gpu: bool
) -> Transport:
    return Transport(
        name,
        line * efficiency,
        NIXL_REQUEST_S + wire_s,
        f"{why}; latency: NIXL per-request overhead {NIXL_REQUEST_S * 1e3:g} ms (assumed) + "
        f"{wire_s * 1e6:g} µs on the wire",
        line_rate_bytes_per_s=line,
        link_per_gpu=per_gpu,
    )


TRANSPORTS: dict[str, Transport] = {
    t.name: t
    for t in (
        Transport(
            "file+http",
            0.8 * GB,
            FILE_HTTP_REQUEST_S,
            "today's path (flowprefill/kv/transport.py HTTPPullTransport): the safetensors "
            "file written (1.5 GB/s, measured here: CRC-32 + save_file) then pulled over "
            "Python HTTP (uvicorn FileResponse + httpx), 0.6–1.0 GB/s measured on loopback "
            "for 64–512 MiB (../shared/notes/nixl.md), 0.8 taken; 5 ms per request assumed. "
            "Rank 0 writes every head: no per-rank mode",
            staging_bytes_per_s=FILE_STAGING_BYTES_PER_S,
            per_rank=False,
        ),
        _link(
            "tcp-25g",
            25e9 / 8,
            0.8,
            50e-6,
            "25 GbE, 3.125 GB/s line; TCP at MTU 1500 carries at most 94 % of it as payload "
            "and NIXL's UCX TCP path copies through host memory: 80 % assumed; one NIC per "
            "node shared by its GPUs",
            per_gpu=False,
        ),
        _link(
            "tcp-100g",
            100e9 / 8,
            0.5,
            50e-6,
            "100 GbE, 12.5 GB/s line; one TCP stream is CPU-bound well below 100 Gb/s, so "
            "50 % assumed; one NIC per node shared by its GPUs",
            per_gpu=False,
        ),
        _link(
            "rdma-200g",
            200e9 / 8,
            0.8,
            5e-6,
            "InfiniBand HDR / 200 Gb/s RoCE, 25 GB/s line, GPUDirect RDMA; large-message "
            "RDMA writes come near the line, but paged KV moves as many block-sized pieces "
            "(tens of KiB per layer and block): 80 % assumed; a NIC per GPU (DGX-style)",
            per_gpu=True,
        ),
        _link(
            "rdma-400g",
            400e9 / 8,
            0.8,
            5e-6,
            "InfiniBand NDR, 50 GB/s line, GPUDirect RDMA; 80 % assumed as for rdma-200g; "
            "a NIC per GPU (DGX H100)",
            per_gpu=True,
        ),
        _link(
            "nvlink",
            450e9,
            NVLINK_EFFICIENCY,
            5e-6,
            "H100 NVLink 4 (NVIDIA H100 datasheet: 900 GB/s bidirectional, 450 GB/s per "
            "direction), prefill and decode GPUs in one NVLink domain; 80 % assumed",
            per_gpu=True,
        ),
    )
}
DEFAULT_TRANSPORT = "file+http"
TBT_SLOS_S = PAPER_TBT_SLOS_S
"""The first gap is judged against the class's TBT SLO (§6.5; never scaled)."""


def get_transport(name: str) -> Transport:
    transport = TRANSPORTS.get(name.lower())
    if transport is None:
        raise UnknownNameError("transport", name, list(TRANSPORTS))
    return transport


class SecondTokenModel:
    """Hand-off and first decode step of ``model`` at TP ``tp`` on ``gpu`` over
    ``transport`` (module docstring). Every figure is ``fixed + per_token × n``."""

    def __init__(
        self,
        model: ModelShape,
        gpu: GPUSpec,
        transport: Transport,
        *,
        tp: int | None = None,
        gather_to_rank0: bool = True,
        dtype_bytes: int = 2,
    ) -> None:
        tp = model.default_tp if tp is None else tp
        if tp < 1:
            raise InvalidRequestError(f"tensor-parallel degree must be ≥ 1, got {tp}")
        if not gather_to_rank0 and tp > 1 and not transport.per_rank:
            raise InvalidRequestError(
                f"transport {transport.name} sends from rank 0 only: per-rank KV needs a "
                f"transport that can send each rank's heads ({', '.join(_per_rank_names())})"
            )
        self.model, self.gpu, self.transport = model, gpu, transport
        self.tp, self.gather_to_rank0 = tp, gather_to_rank0
        self.kv_bytes_per_token = model.kv_bytes_per_token(dtype_bytes)
        # Bytes of one token one rank holds (heads replicate when TP > KV heads).
        rank_bytes = model.num_layers * model.kv_bytes_per_token_per_layer(tp, dtype_bytes)
        gather_s = 0.0
        if tp > 1 and gather_to_rank0:
            # Rank 0 receives the other ranks' share over its NVLink.
            link = gpu.nvlink_bytes_per_s * NVLINK_EFFICIENCY
            gather_s = (tp - 1) / tp * self.kv_bytes_per_token / link
        if tp == 1 or gather_to_rank0:
            sent, streams = self.kv_bytes_per_token, 1
        else:
            sent, streams = rank_bytes, tp
        # Parallel senders add up only on a link per GPU; on a shared NIC they split it.
        rate = transport.bandwidth_bytes_per_s
        wire_s = sent / rate if transport.link_per_gpu else sent * streams / rate
        staging = transport.staging_bytes_per_s
        stage_s = sent / staging if staging is not None else 0.0  # each rank writes its own
        self.handoff_fixed_s = transport.latency_s + (ALLREDUCE_LATENCY_S if gather_s else 0.0)
        self.handoff_per_token_s = gather_s + stage_s + wire_s
        hbm = gpu.hbm_bytes_per_s * DECODE_HBM_EFFICIENCY
        weights_s = model.decode_weight_params * dtype_bytes / tp / hbm
        comm_s = 2 * model.num_layers * ALLREDUCE_LATENCY_S if tp > 1 else 0.0
        self.step_fixed_s = PASS_OVERHEAD_S + weights_s + comm_s
        self.step_per_token_s = rank_bytes / hbm
        mode = "gathered" if gather_to_rank0 or tp == 1 else "per-rank"
        self.name = f"{model.name}/{gpu.name}/tp{tp}/{transport.name}/{mode}"

    def kv_bytes(self, num_tokens: int) -> int:
        """The prompt's KV, all layers and heads: what decode needs."""
        return num_tokens * self.kv_bytes_per_token

    def handoff_s(self, num_tokens: int) -> float:
        """From the first token until decode holds the KV."""
        return self.handoff_fixed_s + num_tokens * self.handoff_per_token_s

    def decode_step_s(self, context_tokens: int) -> float:
        """One decode step of this request alone over ``context_tokens`` of KV."""
        return self.step_fixed_s + context_tokens * self.step_per_token_s

    def first_gap_s(self, num_tokens: int) -> float:
        """Second token − first token: the hand-off, then one step over the prompt and
        the first token (decode pool unsaturated: no queueing)."""
        return self.handoff_s(num_tokens) + self.decode_step_s(num_tokens + 1)


def _per_rank_names() -> list[str]:
    return [t.name for t in TRANSPORTS.values() if t.per_rank]


def build_second_token(
    model: str,
    gpu: str,
    transport: str = DEFAULT_TRANSPORT,
    *,
    tp: int | None = None,
    gather_to_rank0: bool = True,
) -> SecondTokenModel:
    """By name; unknown names raise UnknownNameError listing the known ones."""
    return SecondTokenModel(
        get_model(model),
        get_gpu(gpu),
        get_transport(transport),
        tp=tp,
        gather_to_rank0=gather_to_rank0,
    )


FirstGapCounts = dict[str, tuple[int, int]]
"""class → (requests whose first gap met the class's TBT SLO, requests of the class with
one); a request counts as met only if its prefill finished."""


def attach_second_token(
    result: SimResult, second: SecondTokenModel, tbt_slos_s: dict[str, float] = TBT_SLOS_S
) -> FirstGapCounts:
    """Fill ``result.decode_start_s`` (first token + hand-off) and ``result.first_gap_s``
    for every finished request (None for the others, in ``result.requests`` order) and
    count the first gaps within each class's TBT SLO (classes without one: not counted)."""
    starts: list[float | None] = []
    gaps: list[float | None] = []
    counts: dict[str, list[int]] = {}
    for r in result.requests:
        tbt = tbt_slos_s.get(r.slo_class)
        slot = counts.setdefault(r.slo_class, [0, 0]) if tbt is not None else None
        if slot is not None:
            slot[1] += 1
        if r.state is not RequestState.FINISHED or r.finish_s is None:
            starts.append(None)
            gaps.append(None)
            continue
        gap = second.first_gap_s(r.num_tokens)
        starts.append(r.finish_s + second.handoff_s(r.num_tokens))
        gaps.append(gap)
        if slot is not None and tbt is not None and gap <= tbt:
            slot[0] += 1
    result.decode_start_s, result.first_gap_s = starts, gaps
    return {c: (v[0], v[1]) for c, v in sorted(counts.items())}
