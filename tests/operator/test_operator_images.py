"""Dockerfiles: pinned, non-root, and every entry point they (and the operator) call exists."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest
from flowprefill_operator.builders.gateway import gateway_command
from flowprefill_operator.builders.processes import pool_process
from flowprefill_operator.models import ServingPoolSpec
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
IMAGES = sorted((ROOT / "images").glob("*/Dockerfile"))


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def exec_form(path: Path, word: str) -> list[str]:
    values = [rest for w, rest in instructions(path) if w == word]
    assert values, f"{path}: no {word}"
    parsed = json.loads(values[-1])  # exec form only: no shell in between
    assert isinstance(parsed, list)
    return [str(p) for p in parsed]


def test_there_is_an_image_per_process() -> None:
    assert {p.parent.name for p in IMAGES} == {"operator", "prefill", "decode", "gateway"}


@pytest.mark.parametrize("path", IMAGES, ids=lambda p: p.parent.name)
def test_pinned_and_non_root(path: Path) -> None:
    ins = instructions(path)
    args = {
        rest.split("=", 1)[0]: rest.split("=", 1)[1]
        for w, rest in ins
        if w == "ARG" and "=" in rest
    }
    for word, rest in ins:
        if word == "FROM":
            image = rest.split()[0]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), ""), image)
            if image in {r.split()[-1] for w, r in ins if w == "FROM" and " AS " in r.upper()}:
                continue  # a previous stage
            assert re.search(r":v?\d+(\.\d+)+", image) or "@sha256:" in image, f"unpinned {image}"
            assert not image.endswith(":latest")
        assert not (word == "ADD" and "http" in rest), "no remote ADD"
    users = [rest for w, rest in ins if w == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}, "final stage must not be root"
    final_stage = path.read_text().rsplit("FROM ", 1)[1]
    assert "USER 10001" in final_stage


def test_operator_image_entry_point() -> None:
    path = ROOT / "images" / "operator" / "Dockerfile"
    assert exec_form(path, "ENTRYPOINT") == ["kopf"]
    cmd = exec_form(path, "CMD")
    module = cmd[cmd.index("-m") + 1]
    assert importlib.util.find_spec(module) is not None
    assert shutil.which("kopf", path=str(Path(sys.executable).parent)) is not None
    # The image installs the operator extra under requirements.txt as constraints: every
    # package the extra and the base dependencies name is pinned there, within their range.
    pins = {
        canonicalize_name(req.name): req.specifier
        for req in map(
            Requirement,
            (
                line
                for line in (ROOT / "images/operator/requirements.txt").read_text().splitlines()
                if line.strip() and not line.startswith("#")
            ),
        )
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for req in map(
        Requirement, [*project["dependencies"], *project["optional-dependencies"]["operator"]]
    ):
        pin = pins.get(canonicalize_name(req.name))
        assert pin is not None, f"{req.name} is not pinned in images/operator/requirements.txt"
        (version,) = (s.version for s in pin if s.operator == "==")
        assert version in req.specifier, f"{req.name}: image pins {version}, pyproject {req}"


def _cli_accepts(argv: list[str]) -> None:
    cli = pytest.importorskip("flowprefill.cli")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["flowprefill"] == "flowprefill.cli:main"
    args = cli.build_parser(argv).parse_args(argv)  # SystemExit on unknown flags
    assert args.command == argv[0]


SPEC = ServingPoolSpec.model_validate(
    {"service": "s", "role": "prefill", "model": {"path": "/m"}, "kvHandoff": {"claimName": "kv"}}
)


@pytest.mark.parametrize("name", ["prefill", "gateway"])
def test_engine_images_and_operator_commands_match_the_cli(name: str) -> None:
    path = ROOT / "images" / name / "Dockerfile"
    assert exec_form(path, "ENTRYPOINT") == ["flowprefill"]
    _cli_accepts(exec_form(path, "CMD"))
    operator_command = (pool_process(SPEC) if name == "prefill" else gateway_command()).argv
    assert operator_command[0] == "flowprefill"
    _cli_accepts(operator_command[1:])


def test_decode_image_and_connector() -> None:
    path = ROOT / "images" / "decode" / "Dockerfile"
    entry = exec_form(path, "ENTRYPOINT") + exec_form(path, "CMD")
    assert entry[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    decode = SPEC.model_copy(update={"role": "decode", "engine": None})
    command = pool_process(decode).argv
    assert command[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    for argv in (entry, command):
        config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        module = config["kv_connector_module_path"]
        source = ROOT / (module.replace(".", "/") + ".py")
        assert source.exists(), module
        classes = {
            n.name for n in ast.walk(ast.parse(source.read_text())) if isinstance(n, ast.ClassDef)
        }
        assert config["kv_connector"] in classes
        assert config["kv_role"] == "kv_consumer"


STAND_INS = sorted((ROOT / "images" / "stand-ins").glob("*/Containerfile"))
USAGE_STATS_OFF = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def final_stage_env(path: Path) -> dict[str, str]:
    """The ENV the final stage sets (``ENV K=V K2=V2`` form; later ones win)."""
    stage = path.read_text().rsplit("\nFROM ", 1)[-1]
    env: dict[str, str] = {}
    text = re.sub(r"\\\n", " ", stage)
    for line in text.splitlines():
        line = line.strip()
        if line.upper().startswith("ENV "):
            for pair in line[4:].split():
                key, _, value = pair.partition("=")
                env[key] = value.strip('"')
    return env


@pytest.mark.parametrize(
    "path", [*IMAGES, *STAND_INS], ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}"
)
def test_every_image_turns_usage_statistics_off(path: Path) -> None:
    env = final_stage_env(path)
    assert {k: env.get(k) for k in USAGE_STATS_OFF} == USAGE_STATS_OFF, path


def test_stand_ins_are_found() -> None:
    assert {p.parent.name for p in STAND_INS} >= {"vllm-cpu", "vllm-env-py312"}


@pytest.mark.parametrize("cpu", [True, False])
def test_decode_processes_turn_usage_statistics_off(cpu: bool) -> None:
    from flowprefill.contracts.processes import decode_env

    assert USAGE_STATS_OFF.items() <= decode_env(cpu=cpu).items()
    decode = SPEC.model_copy(update={"role": "decode", "engine": None})
    # The operator's decode container, whatever image the user runs it on.
    assert USAGE_STATS_OFF.items() <= pool_process(decode).env.items()


def test_colocated_command_runs_in_the_decode_image() -> None:
    """A colocated pod runs the decode image: the project is installed there from /src with
    the operator's package (the launcher), the launcher imports nothing the image lacks
    (no kopf, no kubernetes client), and the prefill command it runs parses with the CLI."""
    import subprocess

    from flowprefill_operator.builders import PoolRef, build_pool_children
    from flowprefill_operator.colocated import LAUNCHER_MODULE, LaunchSpec
    from flowprefill_operator.settings import OperatorSettings

    steps = instructions(ROOT / "images" / "decode" / "Dockerfile")
    assert ("COPY", "operator /src/operator") in steps
    assert any(w == "RUN" and "pip install" in r and " /src" in r for w, r in steps)
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert "operator" in find["find"]["where"]
    assert "flowprefill_operator*" in find["find"]["include"]
    spec = ServingPoolSpec.model_validate(
        {"service": "s", "role": "colocated", "model": {"path": "/m"}}
    )
    children = build_pool_children(PoolRef("s-colo", "ns", "u", spec), OperatorSettings())
    (container,) = children[1]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == OperatorSettings().decode_image
    command = container["command"]
    assert command[:4] == ["python", "-m", LAUNCHER_MODULE, "run"]
    launch = LaunchSpec.parse(command[4])
    assert launch.prefill.argv[0] == "flowprefill"
    _cli_accepts(launch.prefill.argv[1:])
    assert launch.decode.argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    probe = (
        f"import sys, {LAUNCHER_MODULE}; "
        "print(sorted(m for m in ('kopf', 'kubernetes', 'pydantic', 'flowprefill') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={"PYTHONPATH": str(ROOT / "operator")},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "[]"
