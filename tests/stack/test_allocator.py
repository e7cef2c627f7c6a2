"""Which malloc `flowprefill up` gives its prefill processes (flowprefill/stack/allocator.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from flowprefill.contracts import SLOTable
from flowprefill.stack.allocator import PRELOAD_ENV, preload_env


def test_jemalloc_is_preloaded_where_installed_and_the_user_has_not_chosen() -> None:
    found = {"jemalloc": "libjemalloc.so.2"}.get
    assert preload_env({}, found) == {PRELOAD_ENV: "libjemalloc.so.2"}
    assert preload_env({PRELOAD_ENV: "/opt/libtcmalloc.so"}, found) == {}
    assert preload_env({}, lambda name: None) == {}


def _prefill_envs(tmp_path: Path, *flags: str) -> list[dict[str, str]]:
    from flowprefill.stack.up import add_arguments, plan_stack

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--prefill", "2", "--decode", "0", *flags])
    plan = plan_stack(args, tmp_path / "m", tmp_path / "p.json", SLOTable.paper(), tmp_path)
    return [c.env for c in plan.children if c.name.startswith("prefill-")]


def test_up_preloads_it_into_prefill_unless_told_not_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(PRELOAD_ENV, raising=False)
    monkeypatch.setattr(
        "flowprefill.stack.up.preload_env",
        lambda environ: preload_env(environ, {"jemalloc": "libjemalloc.so.2"}.get),
    )
    envs = _prefill_envs(tmp_path)
    assert [e.get(PRELOAD_ENV) for e in envs] == ["libjemalloc.so.2"] * 2
    assert all(PRELOAD_ENV not in e for e in _prefill_envs(tmp_path, "--system-malloc"))
