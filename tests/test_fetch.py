"""``flowprefill fetch-model``: what lands, what is skipped, and the reason each failure
gives, through the real ``huggingface_hub`` client against a local Hub stand-in."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants

from flowprefill.contracts.deployment import HF_TOKEN_SOURCE_ENV
from flowprefill.contracts.model_uri import HubSource, hub_local_dir, parse_model_uri
from flowprefill.fetch import MARKER, FetchFailure, check, fetch, select_files
from tests.hub_standin import HubStandIn, Repo

GOOD, OTHER = "hf_granted", "hf_not_granted"
WEIGHTS = os.urandom(200_000)
FILES = {
    "config.json": b"{}",
    "tokenizer.json": b'{"model": {}}',
    "model.safetensors": WEIGHTS,
    "pytorch_model.bin": WEIGHTS,  # the same weights again
}


@pytest.fixture(scope="module")
def hub() -> Iterator[HubStandIn]:
    repos = {
        "org/open": Repo(FILES),
        "org/gated": Repo(FILES, gated=True, readers={GOOD}),
        "org/private": Repo(FILES, private=True, readers={GOOD}),
        "org/weights-only": Repo({"model.safetensors": WEIGHTS}),
    }
    with HubStandIn(repos, tokens={GOOD, OTHER}) as h:
        yield h


@pytest.fixture(autouse=True)
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    # The suite runs with HF_HUB_OFFLINE=1 (.ci/run); the client reads it at import.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_files_land_once_and_duplicate_weights_are_skipped(hub: HubStandIn, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    fetch(HubSource("org/open"), dest, endpoint=hub.url)
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS
    assert not (dest / "pytorch_model.bin").exists()
    assert (dest / MARKER).is_file()
    before = len(hub.requests)
    fetch(HubSource("org/open"), dest, endpoint=hub.url)
    assert len(hub.requests) == before + 1  # the listing only: nothing downloaded again


def test_tokenizer_only(hub: HubStandIn, tmp_path: Path) -> None:
    fetch(HubSource("org/open"), tmp_path / "t", tokenizer_only=True, endpoint=hub.url)
    assert sorted(p.name for p in (tmp_path / "t").iterdir() if p.is_file()) == [
        MARKER, "config.json", "tokenizer.json"
    ]  # fmt: skip
    assert select_files(["a.bin"], tokenizer_only=False) == ["a.bin"]  # no safetensors: kept


CASES: list[tuple[str, str | None, str, str]] = [
    ("hf://org/gated", OTHER, "ModelGated", "has no access"),
    ("hf://org/gated", None, "ModelGated", "no token was given"),
    ("hf://org/private", None, "ModelRepositoryNotFound", "repository not found"),
    ("hf://org/missing", GOOD, "ModelRepositoryNotFound", "hf://org/missing"),
    ("hf://org/open@v9", None, "ModelRevisionNotFound", "'v9'"),
    ("hf://org/open", "hf_unknown", "ModelTokenRefused", "the token"),
]


@pytest.mark.parametrize(("uri", "token", "reason", "says"), CASES)
def test_failures_are_classified_alike_by_fetch_and_check(
    hub: HubStandIn, tmp_path: Path, uri: str, token: str | None, reason: str, says: str
) -> None:
    source = parse_model_uri(uri)
    assert isinstance(source, HubSource)
    with pytest.raises(FetchFailure) as failed:
        fetch(source, tmp_path / "x", token=token or False, endpoint=hub.url)  # type: ignore[arg-type]
    assert (failed.value.reason, failed.value.permanent) == (reason, True)
    assert says in failed.value.message and uri.split("@")[0] in failed.value.message
    checked = check(source, token=token, endpoint=hub.url)
    assert checked is not None and checked.reason == reason
    assert check(HubSource("org/gated"), token=GOOD, endpoint=hub.url) is None


def test_tokenizer_only_on_a_repository_without_one(hub: HubStandIn, tmp_path: Path) -> None:
    with pytest.raises(FetchFailure, match="no tokenizer files") as failed:
        fetch(HubSource("org/weights-only"), tmp_path, tokenizer_only=True, endpoint=hub.url)
    assert failed.value.reason == "ModelFileNotFound"


def test_a_cache_too_small_is_refused_before_downloading(
    hub: HubStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = shutil._ntuple_diskusage(1, 1, 1000)  # total, used, free (bytes)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: full)
    with pytest.raises(FetchFailure, match=r"needs 0\.2 MiB but the model cache has") as failed:
        fetch(HubSource("org/open"), tmp_path / "m", endpoint=hub.url)
    assert failed.value.reason == "ModelDiskFull"
    assert not (tmp_path / "m" / "model.safetensors").exists()


def test_offline_is_named(hub: HubStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FetchFailure) as failed:
        fetch(HubSource("org/open"), tmp_path, endpoint=hub.url)
    assert failed.value.reason == "ModelHubOffline"


def cli(args: list[str], env: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "flowprefill"
    return subprocess.run(
        [str(script), "fetch-model", *args], env={**os.environ, **env, "HF_HUB_OFFLINE": "0"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_cli_exit_codes_progress_and_termination_message(hub: HubStandIn, tmp_path: Path) -> None:
    dest = Path(hub_local_dir(HubSource("org/gated"), str(tmp_path)))
    log = tmp_path / "termination-log"
    log.touch()
    base = ["hf://org/gated", "--dest", str(dest), "--termination-log", str(log)]
    ok = cli(base, {"HF_ENDPOINT": hub.url, "HF_TOKEN": GOOD})
    assert ok.returncode == 0, ok.stderr
    assert "[3/3]" in ok.stderr and "MiB/s" in ok.stderr  # one line per file
    # A complete copy is used as it is whatever the token; a new cache needs the files.
    base[2] = str(tmp_path / "other")
    refused = cli(base, {"HF_ENDPOINT": hub.url, "HF_TOKEN": OTHER,
                         HF_TOKEN_SOURCE_ENV: "Secret hf key HF_TOKEN"})  # fmt: skip
    assert refused.returncode == 2
    assert log.read_text().startswith("ModelGated: hf://org/gated is gated and the token from "
                                      "Secret hf key HF_TOKEN")  # fmt: skip
    assert cli(["s3://bucket/x", "--dest", str(dest)], {}).returncode == 2
