"""``flowprefill up``'s command line: its options, their defaults and help, and the
argparse types that refuse a bad value with the valid ones.

:func:`add_arguments` is the whole contract with :mod:`flowprefill.stack.up`: it fills a
parser whose namespace ``up``'s :func:`~flowprefill.stack.up.run` and
:func:`~flowprefill.stack.up.plan_stack` read. Changing an option's name, default or help
here changes ``flowprefill up --help``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from flowprefill.contracts import Batching, Granularity, KVTransport, Name, Policy, Router
from flowprefill.contracts.deployment import (
    DECODE_PORT,
    GATEWAY_PORT,
    PREFILL_KV_PORT,
    PREFILL_PORT,
)
from flowprefill.contracts.engine import (
    DEFAULT_BATCH_TOKEN_BUDGET,
    DEFAULT_TBT_TARGET_S,
    MAX_TP_SIZE,
    max_blocking_arg,
)
from flowprefill.contracts.gateway import OverloadSettings
from flowprefill.errors import UnknownNameError
from flowprefill.stack.decode import DECODE_NICE, DECODE_THREADS
from flowprefill.stack.supervisor import AUTOGROUP_NICE_ENV, RestartPolicy

N = TypeVar("N", bound=Name)


def name_arg(enum: type[N]) -> Callable[[str], N]:
    """An argparse ``type`` for a contracts name: one parser, and a refusal that lists the
    valid names."""

    def parse(value: str) -> N:
        try:
            return enum.parse(value)
        except UnknownNameError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def tp_arg(value: str) -> int:
    """An argparse ``type`` for ``--tp``: the degrees the engine serves."""
    try:
        tp = int(value)
    except ValueError:
        tp = 0
    if not 1 <= tp <= MAX_TP_SIZE:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a tensor-parallel degree: the engine runs 1 to {MAX_TP_SIZE} "
            "ranks per instance"
        )
    return tp


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``up``'s options to ``p``; every option has a default, so ``p.parse_args([])``
    is a complete namespace for :func:`flowprefill.stack.up.plan_stack`."""
    p.add_argument("--model", default="demo-llama", help="built-in tiny model or local dir")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode (vLLM) instances; 0 = none")
    p.add_argument(
        "--port",
        type=int,
        default=GATEWAY_PORT,
        help=f"gateway port; prefill instances listen from +{PREFILL_PORT - GATEWAY_PORT} "
        f"(with --kv-transport http their KV hand-off ports from "
        f"+{PREFILL_KV_PORT - GATEWAY_PORT}), decode from +{DECODE_PORT - GATEWAY_PORT}",
    )
    p.add_argument("--policy", default=Policy.S_EDF, type=name_arg(Policy), choices=list(Policy),
                   help="priority policy")  # fmt: skip
    p.add_argument("--granularity", default=Granularity.OPERATOR, type=name_arg(Granularity),
                   choices=list(Granularity))  # fmt: skip
    p.add_argument(
        "--batching",
        default=Batching.SLO_AWARE,
        type=name_arg(Batching),
        choices=list(Batching),
        help="batching policy (member-headroom: each member's own deadline; docs/simulator.md)",
    )
    p.add_argument(
        "--batch-token-budget",
        type=int,
        default=DEFAULT_BATCH_TOKEN_BUDGET,
        help="most tokens in one batched prefill",
    )
    p.add_argument(
        "--chunk-size", type=int, default=None, help="split prompts into chunks of this many tokens"
    )
    p.add_argument(
        "--max-blocking-ms",
        type=max_blocking_arg,
        default=None,
        help="split operators predicted to run longer than this between two preemption "
        "checkpoints (ms, or off; default: the device's, docs/executor.md)",
    )
    p.add_argument(
        "--parked-memory-mb",
        type=float,
        default=None,
        help="budget for the activations and KV cache preempted prefills hold (MiB; "
        "default unbounded): a preemption that would exceed it is declined (docs/executor.md)",
    )
    p.add_argument(
        "--routing", default=Router.SLACK_AWARE, type=name_arg(Router), choices=list(Router)
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=OverloadSettings().max_waiting,
        help="the gateway answers 503 beyond this many requests waiting for their first "
        "token (gateway.json overload.max_waiting; docs/gateway.md, Overload)",
    )
    p.add_argument(
        "--useful-wait-floor",
        type=float,
        default=OverloadSettings().useful_wait_floor_s,
        help="seconds past its deadline a non-sheddable request may still wait for its "
        "first token, at least, before the gateway answers 503 (gateway.json "
        "overload.useful_wait_floor_s; docs/gateway.md, Overload)",
    )
    p.add_argument("--profile", help="TTFT profile JSON (profiled once at start when absent)")
    p.add_argument(
        "--slo-table",
        help="TTFT SLO per class instead of the paper's scaled to this machine: a JSON file "
        "{class: seconds} (the file `flowprefill bench --slo-table` reads; the paper's four "
        "classes keep their priorities) or a slo-table.json",
    )
    p.add_argument("--run-dir", help="where configs, logs and KV hand-offs go")
    p.add_argument(
        "--tp",
        type=tp_arg,
        default=1,
        help=f"tensor-parallel ranks per prefill instance (1-{MAX_TP_SIZE}): the instance "
        "spawns them as processes on this machine (CPU: gloo; docs/executor.md)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per prefill rank (default with --tp N: this machine's cores / N)",
    )
    p.add_argument(
        "--decode-threads",
        type=int,
        default=DECODE_THREADS,
        help="OpenMP threads of each vLLM decode instance; they share this machine's cores "
        "with prefill (docs/stack.md)",
    )
    p.add_argument(
        "--decode-nice",
        type=int,
        default=DECODE_NICE,
        help="niceness of the decode processes, 0-19, set on each one's session (autogroup) "
        "where the kernel groups by session: when they compete with prefill for the cores, "
        f"the first token comes first (0: equal priority; {AUTOGROUP_NICE_ENV}=0: the "
        "process's nice only; docs/stack.md)",
    )
    p.add_argument(
        "--system-malloc",
        action="store_true",
        help="run prefill with glibc's malloc even where jemalloc is installed (by default "
        "it is preloaded: glibc's keeps the memory of large freed blocks; docs/stack.md)",
    )
    p.add_argument(
        "--decode-aware",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="decode-aware preemption: decode sends its step beats to every prefill "
        "instance, which parks its running prefill for a decode step whose TBT target is "
        "at risk (engine.json decode_aware; docs/executor.md). Off: prefill and decode "
        "share the cores blindly",
    )
    p.add_argument(
        "--decode-aware-tbt",
        type=float,
        default=DEFAULT_TBT_TARGET_S,
        help="with --decode-aware: the TBT target (s) the parks protect (default: the "
        "paper's tightest class, text/image)",
    )
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument(
        "--max-restarts",
        type=int,
        default=RestartPolicy.max_quick_deaths,
        help="stop the stack when a child dies this many times in a row, each soon after "
        "starting (a crash loop); a child that dies later is restarted; 0: never give up",
    )
    p.add_argument(
        "--kv-transport",
        default=KVTransport.NIXL,
        type=name_arg(KVTransport),
        choices=list(KVTransport),
        help="KV hand-off: stock vLLM decode pulls it from prefill's memory over NIXL (nixl), "
        "one shared directory (shared_dir), or each decode pulls a file from prefill over "
        "HTTP into its own cache directory (http)",
    )
    p.add_argument(
        "--nixl-buffer-mb",
        type=float,
        default=256.0,
        help="nixl transport: each prefill instance's registered KV buffer (MiB), which holds "
        "prompts until decode has pulled them",
    )
    p.add_argument(
        "--nixl-progress-thread",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="nixl transport: run NIXL's progress thread in prefill and decode, as on a GPU "
        "node (each polls a core without sleeping; off by default on this CPU host)",
    )
