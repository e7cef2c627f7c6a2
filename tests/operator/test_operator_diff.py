"""The apply planner: patch only what differs, remove what the operator stopped wanting."""

from __future__ import annotations

from flowprefill_operator.diff import covers, last_applied, plan_patch, with_last_applied


def test_in_sync_when_live_has_extra_server_fields() -> None:
    desired = {"spec": {"replicas": 2, "template": {"containers": [{"name": "c", "image": "i"}]}}}
    live = {
        "metadata": {"uid": "u", "resourceVersion": "7"},
        "spec": {
            "replicas": 2,
            "progressDeadlineSeconds": 600,
            "template": {"containers": [{"name": "c", "image": "i", "imagePullPolicy": "Always"}]},
        },
        "status": {"readyReplicas": 1},
    }
    assert covers(desired, live)
    assert plan_patch(desired, live, {}) == {}


def test_changed_scalar_and_list_are_patched_whole() -> None:
    desired = {"spec": {"replicas": 3, "args": ["a", "b"]}}
    live = {"spec": {"replicas": 2, "args": ["a"], "other": 1}}
    assert plan_patch(desired, live, {}) == {"spec": {"replicas": 3, "args": ["a", "b"]}}


def test_keys_dropped_from_desired_are_removed_only_if_we_wrote_them() -> None:
    last = {"spec": {"nodeSelector": {"gpu": "a100", "zone": "a"}}}
    desired = {"spec": {"nodeSelector": {"gpu": "a100"}}}
    live = {"spec": {"nodeSelector": {"gpu": "a100", "zone": "a", "added-by-someone": "x"}}}
    assert plan_patch(desired, live, last) == {"spec": {"nodeSelector": {"zone": None}}}


def test_last_applied_round_trip() -> None:
    manifest = {"kind": "ConfigMap", "metadata": {"name": "x", "labels": {"a": "b"}}, "data": {}}
    stamped = with_last_applied(manifest)
    assert last_applied(stamped) == manifest
    assert with_last_applied(stamped) == stamped  # stamping is idempotent
    assert last_applied({"metadata": {"annotations": {"flowprefill.io/last-applied": "{"}}}) == {}
