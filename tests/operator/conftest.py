"""Shared fixtures of the operator tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operator.crdcheck import ROOT, load_crds


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    return load_crds()


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]
