"""SLOClass status: Ready and Degraded conditions, and attainment written at a rate that
does not churn etcd (:mod:`flowprefill_operator.classstatus` states the rule)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from flowprefill_operator.builders import Verdict
from flowprefill_operator.classstatus import (
    REFRESH_S,
    attainment_patch,
    set_condition,
)
from flowprefill_operator.controllers.common import Context, KeyedLocks
from flowprefill_operator.controllers.indexes import ClassEntry, classes_by_namespace
from flowprefill_operator.controllers.scraper import write_class_attainment
from flowprefill_operator.controllers.sloclass import write_verdict
from flowprefill_operator.kube import ApiError, Kube
from flowprefill_operator.models import Condition
from flowprefill_operator.settings import OperatorSettings
from flowprefill_operator.statuspatch import CONFLICT_ATTEMPTS

from tests.operator.cluster import Cluster, create, pool, slo
from tests.operator.emulator import EmulatorThread
from tests.operator.fake_gateway import FakeGateway
from tests.operator.harness import kube_for, wait_for

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def fields(attainment: float | None, requests: int) -> dict[str, Any]:
    return {
        "attainment": attainment,
        "requestCount": requests,
        "shedCount": 0,
        "windowSeconds": 300,
    }


def written(status: dict[str, Any], patch: dict[str, Any] | None) -> dict[str, Any]:
    assert patch is not None
    return {**status, **patch["status"]}


def degraded(status: dict[str, Any]) -> tuple[str, str]:
    c = next(c for c in status["conditions"] if c["type"] == "Degraded")
    return c["status"], c["reason"]


def test_first_window_is_written_with_its_condition() -> None:
    status = written({}, attainment_patch({}, fields(None, 0), 0.9, 1, T0))
    assert degraded(status) == ("False", "NoTraffic")
    assert status["attainmentTime"] == "2026-01-01T00:00:00Z"


def test_small_changes_wait_for_the_refresh_period() -> None:
    status = written({}, attainment_patch({}, fields(0.95, 400), 0.9, 1, T0))
    assert degraded(status) == ("False", "AttainmentMet")
    # More requests, attainment within a point: not written for 5 minutes.
    for seconds in (30, 60, 290):
        later = T0 + timedelta(seconds=seconds)
        assert attainment_patch(status, fields(0.955, 400 + seconds), 0.9, 1, later) is None
    later = T0 + timedelta(seconds=REFRESH_S)
    status = written(status, attainment_patch(status, fields(0.955, 700), 0.9, 1, later))
    assert status["requestCount"] == 700
    # Nothing changed at all: never written, however old.
    much_later = later + timedelta(hours=1)
    assert attainment_patch(status, fields(0.955, 700), 0.9, 1, much_later) is None


def test_a_point_of_attainment_or_a_condition_change_is_written_at_once() -> None:
    status = written({}, attainment_patch({}, fields(0.95, 400), 0.9, 1, T0))
    soon = T0 + timedelta(seconds=30)
    status = written(status, attainment_patch(status, fields(0.94, 430), 0.9, 1, soon))
    assert status["attainment"] == 0.94
    # Below the target: Degraded turns True with its reason, at once.
    status = written(status, attainment_patch(status, fields(0.899, 460), 0.9, 1, soon))
    assert degraded(status) == ("True", "AttainmentBelowTarget")
    cond = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert "0.8990 < target 0.9" in cond["message"]
    # Too few requests to judge: NoTraffic, not Degraded.
    quiet = written(status, attainment_patch(status, fields(0.5, 3), 0.9, 1, soon))
    assert degraded(quiet) == ("False", "NoTraffic")


def test_transition_time_moves_only_with_the_status() -> None:
    ready = Condition(type="Ready", status="True", reason="Accepted")
    first = set_condition([], ready, "t1")
    again = set_condition(first, ready.model_copy(update={"message": "m"}), "t2")
    assert again[0].last_transition_time == "t1"
    flipped = set_condition(again, ready.model_copy(update={"status": "False"}), "t3")
    assert flipped[0].last_transition_time == "t3"


def conditions(c: Cluster, ns: str, name: str) -> dict[str, tuple[str, str]]:
    status = c.get("SLOClass", ns, name).get("status") or {}
    return {x["type"]: (x["status"], x["reason"]) for x in status.get("conditions", [])}


def test_ready_condition_follows_the_verdict(cluster: Cluster) -> None:
    ns = "slo-ready"
    create(cluster, slo("chat", 250, default=True), ns)
    create(cluster, pool("m-prefill", "m"), ns)
    wait_for(lambda: conditions(cluster, ns, "chat").get("Ready") == ("True", "Accepted"))
    create(cluster, slo("second", 300, default=True), ns)
    wait_for(
        lambda: conditions(cluster, ns, "second").get("Ready") == ("False", "DuplicateDefault"),
        what="a second default is not Ready",
    )


def test_degraded_below_target_and_no_churn(cluster: Cluster) -> None:
    ns = "slo-degraded"
    gateway = FakeGateway()
    try:
        create(cluster, slo("chat", 250, default=True, attainmentTarget=0.9), ns)
        create(cluster, pool("m-prefill", "m"), ns)
        create(cluster, gateway.pod("m"), ns)
        wait_for(
            lambda: conditions(cluster, ns, "chat").get("Degraded") == ("False", "NoTraffic"),
            what="baseline window",
        )
        gateway.add("chat", met=50, missed=50)
        wait_for(
            lambda: (
                conditions(cluster, ns, "chat").get("Degraded") == ("True", "AttainmentBelowTarget")
            ),
            what="Degraded/AttainmentBelowTarget",
        )
        assert conditions(cluster, ns, "chat")["Ready"] == ("True", "Accepted")
        # Steady traffic at the same attainment: counts grow on every 1 s scrape, but the
        # status is not rewritten within the refresh period.
        before = cluster.emulator.write_count("sloclasses", ns, ("patch/status",))
        for _ in range(5):
            gateway.add("chat", met=10, missed=10)
            time.sleep(1.0)
        assert cluster.emulator.write_count("sloclasses", ns, ("patch/status",)) == before
    finally:
        gateway.server.shutdown()


# ---- two writers of one status: neither loses the other's condition --------------------
# The class sync writes Ready, the attainment job Degraded; each sends the whole
# conditions list (a merge patch replaces lists). These tests drive both writers by hand
# against an emulator with no operator, so the interleaving is the test's.

NS = "races"
SINCE = "2026-01-01T00:00:00Z"
WRITTEN_ONCE = {
    "accepted": True,
    "reason": "Accepted",
    "message": "",
    "observedGeneration": 1,
    "conditions": [
        {"type": "Ready", "status": "True", "reason": "Accepted", "message": "",
         "observedGeneration": 1, "lastTransitionTime": SINCE},
        {"type": "Degraded", "status": "False", "reason": "NoTraffic", "message": "",
         "observedGeneration": 1, "lastTransitionTime": SINCE},
    ],
}  # fmt: skip
BELOW = fields(0.5, 100)  # attainment 0.5 over 100 requests: Degraded against 0.9
ACCEPTED = Verdict(True, "Accepted", "")
REFUSED = Verdict(False, "SecretNotFound", "Secret keys not found")
BOTH_NEW = {"Ready": ("False", "SecretNotFound"), "Degraded": ("True", "AttainmentBelowTarget")}


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Iterator[Kube]:
    """An emulator with the CRDs and no operator: only the test writes."""
    emulator = EmulatorThread(sorted((repo_root / "crds").glob("*.yaml"))).start()
    try:
        yield kube_for(emulator.write_kubeconfig(tmp_path_factory.mktemp("bare") / "kubeconfig"))
    finally:
        emulator.stop()


def read(kube: Kube, name: str) -> dict[str, Any]:
    body = kube.get("SLOClass", NS, name)
    assert body is not None
    return body


def class_written_once(kube: Kube, name: str) -> dict[str, Any]:
    """A class whose status both writers have written once (Ready True, Degraded False);
    returns the body as read then."""
    obj = slo(name, 250, attainmentTarget=0.9)
    kube.create({**obj, "metadata": {"name": name, "namespace": NS}})
    kube.patch("SLOClass", NS, name, {"status": WRITTEN_ONCE}, sub="status")
    return read(kube, name)


def entry_of(body: dict[str, Any]) -> ClassEntry:
    """The class as the operator's index holds it: its status as of ``body``."""
    meta = body["metadata"]
    index_fn: Any = classes_by_namespace  # kopf types the decorated function as its protocol
    entries: dict[str, ClassEntry] = index_fn(
        body=body, name=meta["name"], namespace=meta["namespace"]
    )
    return entries[meta["namespace"]]


def context_of(kube: Kube) -> Context:
    return Context(kube, OperatorSettings(), KeyedLocks())


def conditions_of(kube: Kube, name: str) -> dict[str, tuple[str, str]]:
    status = read(kube, name).get("status") or {}
    return {c["type"]: (c["status"], c["reason"]) for c in status.get("conditions", [])}


def test_a_stale_verdict_write_keeps_the_attainment_jobs_condition(bare: Kube) -> None:
    ctx = context_of(bare)
    stale = entry_of(class_written_once(bare, "sync-last"))  # the class sync read this ...
    assert write_class_attainment(ctx, NS, entry_of(read(bare, "sync-last")), BELOW)
    assert write_verdict(ctx, stale, REFUSED)  # ... and writes after the attainment job
    assert conditions_of(bare, "sync-last") == BOTH_NEW
    status = read(bare, "sync-last")["status"]
    assert (status["attainment"], status["requestCount"], status["accepted"]) == (0.5, 100, False)


def test_a_stale_attainment_write_keeps_the_class_syncs_condition(bare: Kube) -> None:
    ctx = context_of(bare)
    stale = entry_of(class_written_once(bare, "job-last"))  # the attainment job read this ...
    assert write_verdict(ctx, entry_of(read(bare, "job-last")), REFUSED)
    assert write_class_attainment(ctx, NS, stale, BELOW)  # ... and writes after the sync
    assert conditions_of(bare, "job-last") == BOTH_NEW
    assert read(bare, "job-last")["status"]["reason"] == "SecretNotFound"


class RecordingKube(Kube):
    """The test's client, recording GETs and status patches; ``race``, if given, runs
    once just before the first status patch is sent (the other writer gets there first)."""

    def __init__(self, kube: Kube, race: Callable[[], object] | None = None) -> None:
        super().__init__(kube.api, kube.timeout_s)
        self.race = race
        self.gets = 0
        self.status_patches: list[dict[str, Any]] = []
        self.errors: list[int] = []

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.gets += 1
        return super().get(kind, namespace, name)

    def patch(
        self, kind: str, namespace: str, name: str, patch: dict[str, Any], sub: str | None = None
    ) -> dict[str, Any]:
        if sub == "status":
            self.status_patches.append(patch)
            race, self.race = self.race, None
            if race is not None:
                race()
        try:
            return super().patch(kind, namespace, name, patch, sub)
        except ApiError as e:
            self.errors.append(e.status)
            raise


def test_a_write_that_loses_the_race_is_a_conflict_and_is_redone(bare: Kube) -> None:
    body = class_written_once(bare, "conflict")
    job = lambda: write_class_attainment(context_of(bare), NS, entry_of(body), BELOW)  # noqa: E731
    racing = RecordingKube(bare, race=job)
    assert write_verdict(context_of(racing), entry_of(body), REFUSED)
    assert racing.errors == [409]  # sent with the version it had read: refused ...
    first, second = racing.status_patches  # ... then read again and sent again
    assert first["metadata"]["resourceVersion"] == body["metadata"]["resourceVersion"]
    assert second["metadata"]["resourceVersion"] != body["metadata"]["resourceVersion"]
    assert conditions_of(bare, "conflict") == BOTH_NEW


def test_conflicts_without_end_are_given_up(bare: Kube) -> None:
    before = class_written_once(bare, "endless")

    class Contended(RecordingKube):
        def patch(
            self, kind: str, namespace: str, name: str, patch: dict[str, Any],
            sub: str | None = None,
        ) -> dict[str, Any]:  # fmt: skip
            self.status_patches.append(patch)
            raise ApiError(409, "Conflict", "the object has been modified")

    contended = Contended(bare)
    with pytest.raises(ApiError) as raised:
        write_verdict(context_of(contended), entry_of(before), REFUSED)
    assert raised.value.status == 409
    assert len(contended.status_patches) == contended.gets == CONFLICT_ATTEMPTS
    assert read(bare, "endless") == before


def test_nothing_due_nothing_written(bare: Kube) -> None:
    """The write-rate rules hold: no write when the status says it all already, and the
    attainment job (every interval) does not even read the object then."""
    assert write_class_attainment(
        context_of(bare), NS, entry_of(class_written_once(bare, "quiet")), BELOW
    )
    current = read(bare, "quiet")
    recording = RecordingKube(bare)
    assert not write_class_attainment(context_of(recording), NS, entry_of(current), BELOW)
    assert recording.gets == 0
    assert not write_verdict(context_of(recording), entry_of(current), ACCEPTED)
    assert recording.status_patches == []
    assert read(bare, "quiet") == current


def test_the_emulator_refuses_a_stale_resource_version(bare: Kube) -> None:
    """As the API server: a write carrying metadata.resourceVersion is a 409 Conflict
    unless that is the stored version; one without it is not checked."""
    version = class_written_once(bare, "precondition")["metadata"]["resourceVersion"]
    patch = {"status": {"reason": "x"}, "metadata": {"resourceVersion": version}}
    bare.patch("SLOClass", NS, "precondition", patch, sub="status")  # current: written
    for sub in ("status", None):
        with pytest.raises(ApiError) as raised:
            bare.patch("SLOClass", NS, "precondition", patch, sub=sub)  # stale now
        assert (raised.value.status, raised.value.reason) == (409, "Conflict")
        assert 'sloclasses.flowprefill.io "precondition": the object has been modified' in (
            raised.value.message
        )
    assert read(bare, "precondition")["status"]["reason"] == "x"
    bare.patch("SLOClass", NS, "precondition", {"status": {"reason": "y"}}, sub="status")
    assert read(bare, "precondition")["status"]["reason"] == "y"
