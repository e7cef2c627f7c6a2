"""`flowprefill up` as a user runs it: starts, answers, stops everything on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from flowprefill.cli import main
from flowprefill.contracts import EngineConfig
from tests.helpers import start_up, stop_tree


@pytest.mark.parametrize(("prefill", "tp"), [(2, 1), (1, 2)], ids=["2x-tp1", "1x-tp2"])
def test_prefill_only_stack_serves_and_stops_cleanly(tmp_path: Path, prefill: int, tp: int) -> None:
    """``up`` with ``--tp 2`` too: the prefill instance then spawns its second rank."""
    up = start_up(
        tmp_path,
        *("--decode", "0", "--prefill", str(prefill), "--tp", str(tp)),
        *("--batching", "member-headroom", "--batch-token-budget", "2048"),
    )
    proc, port = up.proc, up.port
    try:
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"model": "tiny-llama", "prompt": "Hello", "max_tokens": 1},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-flowprefill-slo-class"] == "text"
        assert {p.name for p in (tmp_path / "run").iterdir()} >= {
            "engine-0.json",
            "gateway.json",
            "slo-table.json",
            "logs",
        }
        engine = EngineConfig.load(tmp_path / "run" / f"engine-{prefill - 1}.json")
        assert (engine.batching, engine.batch_token_budget) == ("member-headroom", 2048)
        assert engine.tp_size == tp
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        stop_tree(proc)
    # Every child is gone with it: nothing answers on the gateway port any more.
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        alive = True
    except httpx.HTTPError:
        alive = False
    assert not alive


def test_decode_with_an_unsupported_head_size_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    monkeypatch.setenv("FLOWPREFILL_MODEL_CACHE", str(tmp_path / "models"))
    code = main(["up", "--model", "tiny-llama", "--decode", "1", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    if importlib.util.find_spec("vllm") is None:
        assert "vLLM" in err and "--decode 0" in err
    else:
        assert "head_dim 16" in err


def test_unknown_engine_policy_names_are_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flag, value in (("--batching", "biggest-first"), ("--policy", "lifo")):
        with pytest.raises(SystemExit) as exc:
            main(["up", flag, value, "--run-dir", str(tmp_path)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: unknown" in err and f"'{value}'; expected one of" in err
    assert not any(tmp_path.iterdir())


def _plan(tmp_path: Path, *flags: str) -> dict[str, EngineConfig]:
    import argparse

    from flowprefill.contracts import SLOTable
    from flowprefill.stack.up import add_arguments, plan_stack

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--prefill", "2", *flags])
    plan = plan_stack(args, tmp_path / "m", tmp_path / "p.json", SLOTable.paper(), tmp_path)
    return {
        name: EngineConfig.model_validate_json(text)
        for name, text in plan.files.items()
        if name.startswith("engine-")
    }


def test_tp_runs_every_prefill_instance_with_n_ranks_sharing_the_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("flowprefill.stack.up.machine_cores", lambda: 8)
    engines = _plan(tmp_path, "--tp", "2")
    assert [(e.tp_size, e.num_threads) for e in engines.values()] == [(2, 4), (2, 4)]
    assert {e.tp_size for e in _plan(tmp_path, "--tp", "8").values()} == {8}
    assert {e.num_threads for e in _plan(tmp_path, "--tp", "8").values()} == {1}
    # --threads wins; one rank keeps torch's default as before.
    assert {e.num_threads for e in _plan(tmp_path, "--tp", "2", "--threads", "3").values()} == {3}
    assert {(e.tp_size, e.num_threads) for e in _plan(tmp_path).values()} == {(1, None)}


def test_parked_memory_budget_reaches_every_engine_json(tmp_path: Path) -> None:
    assert {e.parked_memory_bytes for e in _plan(tmp_path).values()} == {None}
    budget = {e.parked_memory_bytes for e in _plan(tmp_path, "--parked-memory-mb", "512").values()}
    assert budget == {512 * 2**20}


@pytest.mark.parametrize("value", ["0", "9", "-1", "two"])
def test_tp_outside_what_the_engine_serves_is_refused_before_anything_starts(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["up", "--tp", value, "--run-dir", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --tp: '{value}' is not a tensor-parallel degree" in err
    assert "1 to 8 ranks per instance" in err
    assert not any(tmp_path.iterdir())


def _children(tmp_path: Path, *flags: str) -> dict[str, Any]:
    import argparse

    from flowprefill.contracts import SLOTable
    from flowprefill.stack.up import add_arguments, plan_stack

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(list(flags))
    plan = plan_stack(args, tmp_path / "m", tmp_path / "p.json", SLOTable.paper(), tmp_path)
    return {c.name: c for c in plan.children}


def test_decode_yields_the_shared_cores_to_prefill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On one machine decode runs one unpinned OpenMP thread that sleeps when idle, at a
    lower CPU priority; prefill and the gateway keep their defaults (docs/stack.md)."""
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)
    children = _children(tmp_path)
    decode = children["decode-0"]
    assert decode.nice == 10
    assert {k: decode.env[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")} == {
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    assert decode.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    for name in ("prefill-0", "gateway"):
        assert children[name].nice == 0 and "OMP_WAIT_POLICY" not in children[name].env
    tuned = _children(tmp_path, "--decode-threads", "2", "--decode-nice", "0")["decode-0"]
    assert (tuned.env["OMP_NUM_THREADS"], tuned.nice) == ("2", 0)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's environment wins
    assert _children(tmp_path)["decode-0"].env["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_nice_child_and_its_children_run_at_lower_priority(tmp_path: Path) -> None:
    from flowprefill.contracts.names import Role
    from flowprefill.contracts.processes import ProcessSpec
    from flowprefill.stack.supervisor import Child

    script = "import os, subprocess, sys; print(os.getpriority(os.PRIO_PROCESS, 0)); " + (
        "sys.stdout.flush(); subprocess.run([sys.executable, '-c', "
        "'import os; print(os.getpriority(os.PRIO_PROCESS, 0))'])"
    )
    spec = ProcessSpec(Role.DECODE, (sys.executable,), ("-c", script), 0, "/")
    child = Child("decode-0", spec, tmp_path / "log", nice=5)
    child.start()
    assert child.proc is not None and child.proc.wait(30) == 0
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert child.log_path.read_text().split() == [str(min(19, base + 5))] * 2


def test_slo_table_file_replaces_the_scaled_paper_table(tmp_path: Path) -> None:
    from flowprefill.errors import FlowPrefillError
    from flowprefill.stack.slo import load_slo_table

    seconds = tmp_path / "slo.json"
    seconds.write_text(json.dumps({"file": 3.0, "search": 2.0, "text": 0.125, "batch": 9}))
    table = load_slo_table(seconds)
    assert [(c.name, c.ttft_slo_ms, c.priority) for c in table.classes] == [
        ("text", 125, 30),
        ("search", 2000, 10),
        ("file", 3000, 0),
        ("batch", 9000, 0),
    ]
    assert table.default_class == "text"
    assert table.classes[-1].task_type == "other"
    full = tmp_path / "slo-table.json"
    full.write_text(table.model_dump_json())
    assert load_slo_table(full) == table
    for bad in ("{}", '{"text": 0}', '{"text": "fast"}', "[1]", "not json"):
        seconds.write_text(bad)
        with pytest.raises(FlowPrefillError, match="--slo-table"):
            load_slo_table(seconds)


@pytest.mark.parametrize("transport", ["http", "shared_dir"])
def test_every_prefill_instance_gets_its_own_kv_port_with_http(
    tmp_path: Path, transport: str
) -> None:
    """With ``--kv-transport http`` each prefill instance listens for decode on a KV port
    of its own (``--port`` + PREFILL_KV_PORT - GATEWAY_PORT + i) and advertises it; no
    port of the stack is used twice. shared_dir runs no KV listener."""
    from flowprefill.contracts.deployment import (
        GATEWAY_PORT,
        KV_ADVERTISE_URL_ENV,
        PREFILL_KV_PORT,
    )

    children = _children(
        tmp_path, "--port", "9000", "--prefill", "3", "--decode", "2", "--kv-transport", transport
    )
    prefill = [children[f"prefill-{i}"].process for i in range(3)]
    if transport == "http":
        first = 9000 + PREFILL_KV_PORT - GATEWAY_PORT
        assert [p.kv_port for p in prefill] == [first, first + 1, first + 2]
        for p in prefill:
            assert p.args[p.args.index("--kv-port") + 1] == str(p.kv_port)
            assert p.env[KV_ADVERTISE_URL_ENV] == f"http://127.0.0.1:{p.kv_port}"
    else:
        assert all(p.kv_port is None and "--kv-port" not in p.args for p in prefill)
    ports = [c.process.port for c in children.values()] + [p.kv_port for p in prefill if p.kv_port]
    assert len(ports) == len(set(ports)), ports


def test_nixl_is_the_default_and_every_process_gets_its_own_side_channel(tmp_path: Path) -> None:
    """``up`` hands KV over NIXL by default: prefill instance i's side channel is
    ``--port`` + PREFILL_SIDE_CHANNEL_PORT - GATEWAY_PORT + i (in its engine.json, with
    decode's ``--model`` as the served model), decode instance j runs stock vLLM's
    NixlConnector as a consumer on a side channel of its own, with no FlowPrefill
    connector; of our environment only what our vLLM plugin reads on a CPU host (no NIXL
    progress thread, vLLM's idle spin capped), and prefill runs no progress thread either;
    no port is used twice."""
    import argparse

    from flowprefill.contracts import SLOTable
    from flowprefill.contracts.deployment import (
        CPU_VLLM_IDLE_SPIN_S,
        DECODE_SIDE_CHANNEL_PORT,
        GATEWAY_PORT,
        PREFILL_SIDE_CHANNEL_PORT,
        VLLM_IDLE_SPIN_ENV,
    )
    from flowprefill.contracts.nixl import NIXL_PROGRESS_THREAD_ENV, SIDE_CHANNEL_PORT_ENV
    from flowprefill.stack.up import add_arguments, plan_stack

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--port", "9000", "--prefill", "2", "--decode", "2"])
    plan = plan_stack(args, tmp_path / "m", tmp_path / "p.json", SLOTable.paper(), tmp_path)
    children = {c.name: c for c in plan.children}
    sides = []
    for i in range(2):
        engine = EngineConfig.model_validate_json(plan.files[f"engine-{i}.json"])
        assert engine.kv is not None and engine.kv.transport == "nixl" and engine.kv.nixl
        assert (
            engine.kv.nixl.side_channel_port == 9000 + PREFILL_SIDE_CHANNEL_PORT - GATEWAY_PORT + i
        )
        sides.append(engine.kv.nixl.side_channel_port)
        decode = children[f"decode-{i}"].process
        config = json.loads(decode.args[decode.args.index("--kv-transfer-config") + 1])
        assert config["kv_connector"] == "NixlConnector" and config["kv_role"] == "kv_consumer"
        assert "kv_connector_module_path" not in config
        ours = {k: v for k, v in decode.env.items() if "FLOWPREFILL" in k}
        assert ours == {NIXL_PROGRESS_THREAD_ENV: "0", VLLM_IDLE_SPIN_ENV: CPU_VLLM_IDLE_SPIN_S}
        assert engine.kv.nixl.progress_thread is False
        assert decode.env[SIDE_CHANNEL_PORT_ENV] == str(
            9000 + DECODE_SIDE_CHANNEL_PORT - GATEWAY_PORT + i
        )
        sides.append(int(decode.env[SIDE_CHANNEL_PORT_ENV]))
        assert engine.kv.nixl.served_model == decode.args[decode.args.index("--model") + 1]
    ports = [c.process.port for c in children.values()] + sides
    assert len(ports) == len(set(ports)), ports


def test_nixl_progress_thread_flag_turns_it_on_in_prefill_and_decode(tmp_path: Path) -> None:
    """``--nixl-progress-thread``: NIXL's progress threads as on a GPU node, in prefill's
    engine.json and in decode's environment (read by our vLLM plugin)."""
    import argparse

    from flowprefill.contracts import SLOTable
    from flowprefill.contracts.nixl import NIXL_PROGRESS_THREAD_ENV
    from flowprefill.stack.up import add_arguments, plan_stack

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--nixl-progress-thread"])
    plan = plan_stack(args, tmp_path / "m", tmp_path / "p.json", SLOTable.paper(), tmp_path)
    engine = EngineConfig.model_validate_json(plan.files["engine-0.json"])
    assert engine.kv is not None and engine.kv.nixl is not None
    assert engine.kv.nixl.progress_thread is True
    (decode,) = [c for c in plan.children if c.name.startswith("decode")]
    assert decode.env[NIXL_PROGRESS_THREAD_ENV] == "1"  # over the process's "0"
