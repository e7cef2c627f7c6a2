"""What the images must hold to run on a cluster that picks the UID, and what
scripts/build_images.sh refuses before it builds anything."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ["operator", "gateway", "prefill", "decode"]


def dockerfile(name: str) -> str:
    return re.sub(r"\\\n", " ", (ROOT / "images" / name / "Dockerfile").read_text())


def env_keys(text: str) -> set[str]:
    keys: set[str] = set()
    for line in text.splitlines():
        if line.startswith("ENV "):
            keys |= set(re.findall(r"(\w+)=", line.removeprefix("ENV ")))
    return keys


@pytest.mark.parametrize("name", IMAGES)
def test_the_image_runs_as_a_numeric_non_root_user(name: str) -> None:
    # runAsNonRoot can only verify a numeric USER; the last USER is the one that runs.
    users = re.findall(r"^USER\s+(\S+)", dockerfile(name), re.MULTILINE)
    assert users, "no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or gid.isdigit()), users[-1]


@pytest.mark.parametrize("name", IMAGES)
def test_getuser_works_for_a_uid_without_a_passwd_entry(name: str) -> None:
    # OpenShift's restricted-v2 runs an arbitrary UID with no passwd entry: getpass.getuser()
    # (kopf, torch) then needs USER or LOGNAME from the environment.
    assert {"USER", "LOGNAME"} <= env_keys(dockerfile(name))


@pytest.mark.parametrize("name", IMAGES)
def test_no_image_forces_the_hub_offline(name: str) -> None:
    # The pods' fetch-model step downloads; the operator sets HF_HUB_OFFLINE on the serving
    # container itself.
    assert "HF_HUB_OFFLINE" not in env_keys(dockerfile(name))


def test_users_default_bases_are_the_real_ones() -> None:
    # The stand-ins are build arguments of this machine's build, never the defaults.
    assert re.search(r"^ARG BASE=vllm/vllm-openai:v", dockerfile("decode"), re.MULTILINE)
    prefill = dockerfile("prefill")
    index = re.search(r"^ARG TORCH_INDEX_URL=(\S+)", prefill, re.MULTILINE)
    assert index and "cpu" not in index.group(1), "the default torch must be a CUDA build"
    for name in ("operator", "gateway", "prefill"):
        assert re.search(r"^ARG BASE=python:3\.1[1-3]", dockerfile(name), re.MULTILINE), name


def build_images(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "build_images.sh"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stand-ins", "--push", "--registry", "registry.example.com/team"], "stand-in"),
        (["--push"], "--push needs --registry"),
        (["--only", "operator,frontend"], "no image 'frontend'"),
        (["--registry"], "--registry needs a value"),
        (["--tag", "--push"], "--tag needs a value"),
        (["--colour"], "unknown argument"),
    ],
)
def test_build_script_refuses_before_building(args: list[str], message: str) -> None:
    done = build_images(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_build_script_help_names_registry_tag_and_push() -> None:
    done = build_images("--help")
    assert done.returncode == 0
    for option in ("--registry REG", "--tag TAG", "--push", "--authfile", "--stand-ins"):
        assert option in done.stdout, option
