"""docs/walkthrough.md stays true: its manifests are admitted by the CRDs, parse as the
operator parses them and render into pods Kubernetes accepts; the names its commands use
(the download container, the gateway Service, the response header) are the code's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from flowprefill_operator.builders import (
    PoolRef,
    SLOClassView,
    build_gateway_children,
    build_pool_children,
    build_slo_table,
    gateway_name,
    judge_classes,
)
from flowprefill_operator.builders.model import FETCH_CONTAINER
from flowprefill_operator.models import ServingPoolSpec, SLOClassSpec
from flowprefill_operator.settings import OperatorSettings

from flowprefill.contracts.deployment import SLO_CLASS_USED_HEADER
from tests.operator.crdcheck import validate_cr


@pytest.fixture(scope="module")
def text(repo_root: Path) -> str:
    return (repo_root / "docs" / "walkthrough.md").read_text()


def manifests(text: str) -> list[dict[str, Any]]:
    """Every object of the page's ``kubectl apply -f - <<'EOF'`` documents."""
    docs = []
    for body in re.findall(r"<<'EOF'\n(.*?)\nEOF", text, flags=re.S):
        docs += [d for d in yaml.safe_load_all(body) if d and "apiVersion" in d]
    return [d for d in docs if d["apiVersion"].startswith("flowprefill.io/")]


def test_its_manifests_are_admitted_and_render_valid_pods(text: str, crd_schemas: Any) -> None:
    objs = manifests(text)
    pools = [o for o in objs if o["kind"] == "ServingPool"]
    classes = [o for o in objs if o["kind"] == "SLOClass"]
    assert len(pools) == 2 and len(classes) == 2  # two roles, two SLO classes
    for obj in objs:
        obj = {**obj, "metadata": {**obj["metadata"], "namespace": "llm"}}
        assert validate_cr(obj, crd_schemas) == [], obj["metadata"]["name"]
    settings = OperatorSettings()
    refs = [
        PoolRef(p["metadata"]["name"], "llm", "u", ServingPoolSpec.model_validate(p["spec"]))
        for p in pools
    ]
    for ref in refs:
        for child in build_pool_children(ref, settings):
            for version in ("1.30", "1.33", "1.35"):
                kubernetes_validate.validate(child, version, strict=True)
    views = [
        SLOClassView(c["metadata"]["name"], {}, "t0", 1, SLOClassSpec.model_validate(c["spec"]))
        for c in classes
    ]
    verdicts = judge_classes(views, {})
    assert all(v.accepted for v in verdicts.values()), verdicts
    table = build_slo_table(views, [None], verdicts, {})
    assert table.default_class == "chat"
    gateway = build_gateway_children(refs, table, settings)
    for child in gateway:
        kubernetes_validate.validate(child, "1.33", strict=True)
    service = refs[0].spec.service
    assert f"svc/{gateway_name(service)} " in text
    assert f"-c {FETCH_CONTAINER} " in text
    assert SLO_CLASS_USED_HEADER in text
