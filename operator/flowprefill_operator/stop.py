"""``python -m flowprefill_operator.stop``: the chart's pre-delete hook
(``templates/uninstall-hook.yaml``).

``helm uninstall`` deletes the operator's Deployment, its Roles and its ServiceAccount in
one pass without waiting for the pod to stop, so the operator, asked to exit after its
RBAC is gone, could not release kopf's finalizer from the pools
(``controllers/servingpool.py``, ``release_finalizers``): a pool deleted afterwards would
hang in Terminating. Run before Helm deletes anything, this scales the operator to zero
and waits until none of its pods is left, so the operator exits gracefully while it may
still patch the pools.

Best effort by contract: it gives up after ``--timeout`` seconds and exits 0 all the same,
so an operator that does not stop never blocks an uninstall (docs/operator.md, "Uninstall",
says how to release a finalizer left behind). A Deployment already gone is no error.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from .kube import ApiError, Kube, load_client


def parse_selector(text: str) -> dict[str, str]:
    """``a=b,c=d`` (the Deployment's matchLabels) as a dict."""
    return dict(item.split("=", 1) for item in text.split(",") if item)


def stop_operator(
    kube: Kube,
    namespace: str,
    deployment: str,
    selector: dict[str, str],
    timeout_s: float,
    *,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Scale ``deployment`` to 0 and wait for its pods to go; True if they all went
    within ``timeout_s``, False if some were still there (or the API refused to say)."""
    try:
        kube.patch("Deployment", namespace, deployment, {"spec": {"replicas": 0}})
    except ApiError as e:
        if e.status != 404:  # gone already: nothing to stop, but its pods may linger
            print(f"could not scale {namespace}/{deployment} to 0: {e}", file=sys.stderr)
            return False
    deadline = clock() + timeout_s
    while True:
        try:
            left = [p["metadata"]["name"] for p in kube.list("Pod", namespace, selector)]
        except ApiError as e:
            print(f"could not list the operator's pods: {e}", file=sys.stderr)
            return False
        if not left:
            return True
        if clock() >= deadline:
            print(f"operator pods still running after {timeout_s:g}s: {left}", file=sys.stderr)
            return False
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowprefill_operator.stop")
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--deployment", required=True)
    parser.add_argument("--selector", required=True, help="the Deployment's matchLabels, a=b,c=d")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait")
    args = parser.parse_args(argv)
    kube = Kube(load_client())
    stopped = stop_operator(
        kube, args.namespace, args.deployment, parse_selector(args.selector), args.timeout
    )
    print("operator stopped" if stopped else "operator not confirmed stopped; uninstall goes on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
