"""A kmock Kubernetes emulator with the operator running against it (``kopf run``), for
the operator's end-to-end tests; and builders of the objects those tests create."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flowprefill_operator.kube import Kube

from tests.operator.conftest import load_docs
from tests.operator.emulator import EmulatorThread
from tests.operator.harness import OperatorProcess, kube_for

FAST = {
    "FLOWPREFILL_OPERATOR_RECONCILE_INTERVAL_S": "1",
    "FLOWPREFILL_OPERATOR_ATTAINMENT_INTERVAL_S": "1",
    "FLOWPREFILL_OPERATOR_AUTOSCALE_INTERVAL_S": "1",
    "FLOWPREFILL_OPERATOR_SCRAPE_TIMEOUT_S": "1",
    # No Hub in the emulated world (tests/operator/test_operator_hub_source.py brings one).
    "FLOWPREFILL_OPERATOR_MODEL_CHECK": "false",
}
GROUP = "flowprefill.io/v1alpha1"


class Cluster:
    def __init__(self, emulator: EmulatorThread, kube: Kube, operator: OperatorProcess) -> None:
        self.emulator = emulator
        self.kube = kube
        self.operator = operator

    def apply_file(self, path: Path, namespace: str) -> None:
        for doc in load_docs(path):
            doc = copy.deepcopy(doc)
            doc["metadata"]["namespace"] = namespace
            self.kube.create(doc)

    def names(self, kind: str, namespace: str) -> set[str]:
        return {o["metadata"]["name"] for o in self.kube.list(kind, namespace)}

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        obj = self.kube.get(kind, namespace, name)
        assert obj is not None, f"{kind} {namespace}/{name} not found"
        return obj

    def table(self, namespace: str, service: str) -> dict[str, Any]:
        cm = self.get("ConfigMap", namespace, f"{service}-slo-table")
        table: dict[str, Any] = json.loads(cm["data"]["slo-table.json"])
        return table

    def condition(self, namespace: str, pool: str, type_: str) -> tuple[str, str]:
        status = self.get("ServingPool", namespace, pool).get("status") or {}
        for c in status.get("conditions", []):
            if c["type"] == type_:
                return c["status"], c["reason"]
        return ("", "")

    def event_reasons(self, namespace: str, name: str) -> set[str]:
        return {
            e.get("reason", "")
            for e in self.kube.list("Event", namespace)
            if e.get("involvedObject", {}).get("name") == name
        }


@contextmanager
def running_cluster(
    tmp: Path, repo_root: Path, env: dict[str, str] | None = None
) -> Iterator[Cluster]:
    """One emulator with the repo's CRDs and one operator process (1 s timers; ``env``:
    more of its settings)."""
    emulator = EmulatorThread(sorted((repo_root / "crds").glob("*.yaml"))).start()
    kubeconfig = emulator.write_kubeconfig(tmp / "kubeconfig")
    operator = OperatorProcess(kubeconfig, tmp / "operator.log", {**FAST, **(env or {})}).start()
    try:
        yield Cluster(emulator, kube_for(kubeconfig), operator)
    finally:
        operator.stop()
        emulator.stop()


def pool(name: str, service: str, role: str = "prefill", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": GROUP,
        "kind": "ServingPool",
        "metadata": {"name": name},
        "spec": {"service": service, "role": role, "model": {"path": "/models/m"}, **spec},
    }


def slo(name: str, ttft_ms: int, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": GROUP,
        "kind": "SLOClass",
        "metadata": {"name": name},
        "spec": {"taskType": "text", "ttftSloMs": ttft_ms, **spec},
    }


def create(c: Cluster, obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["metadata"]["namespace"] = namespace
    return c.kube.create(obj)
