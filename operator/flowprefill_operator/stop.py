"""``python -m flowprefill_operator.stop``: the chart's pre-delete hook
(``templates/uninstall-hook.yaml``).

``helm uninstall`` deletes the operator's Deployment, its Roles and its ServiceAccount in
one pass without waiting for the pod to stop, so the operator, asked to exit after its
RBAC is gone, could not release kopf's finalizer from the pools
(``controllers/servingpool.py``, ``release_finalizers``): a pool deleted afterwards would
hang in Terminating. Run before Helm deletes anything, this scales the operator to zero
and waits until none of its pods is left, so the operator exits gracefully while it may
still patch the pools.

Then it releases kopf's finalizer (:data:`..finalizer.FINALIZER`, others stay) from every
pool in the namespaces the operator served (``--served-namespace``, or
``--all-namespaces``), because an operator that was killed, crashlooping or never stopped
left it there. Only kopf's timers needed it, and the operator is being uninstalled. After a
timeout an operator still running may put it back on a pool it handles (kopf adds its
finalizer on every event of a pool without it); the output says so.

Best effort by contract: it gives up waiting after ``--timeout`` seconds, reports every API
error, and exits 0 all the same, so it never blocks an uninstall (docs/operator.md,
"Uninstall", says how to release a finalizer left behind). A Deployment already gone is no
error.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from .finalizer import FINALIZER, release_all
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


def release_pools(kube: Kube, namespaces: list[str] | None) -> int:
    """Release kopf's finalizer from the pools in ``namespaces`` (``None``: all), printing
    what was released per namespace and every error; the number released."""
    report = release_all(kube, namespaces)
    for namespace in sorted(report, key=lambda ns: ns or ""):
        entry = report[namespace]
        where = namespace or "(all namespaces)"
        names = f": {', '.join(sorted(entry.released))}" if entry.released else ""
        print(f"namespace {where}: released {FINALIZER} from {len(entry.released)} pools{names}")
        for error in entry.errors:
            print(f"namespace {where}: not released: {error}", file=sys.stderr)
    return sum(len(entry.released) for entry in report.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowprefill_operator.stop")
    parser.add_argument("--namespace", required=True, help="the operator's (the release's)")
    parser.add_argument("--deployment", required=True)
    parser.add_argument("--selector", required=True, help="the Deployment's matchLabels, a=b,c=d")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait")
    served = parser.add_mutually_exclusive_group(required=True)
    served.add_argument(
        "--served-namespace",
        action="append",
        help="a namespace the operator served (repeat for each): release its pools",
    )
    served.add_argument(
        "--all-namespaces", action="store_true", help="the operator served every namespace"
    )
    args = parser.parse_args(argv)
    kube = Kube(load_client())
    stopped = stop_operator(
        kube, args.namespace, args.deployment, parse_selector(args.selector), args.timeout
    )
    print("operator stopped" if stopped else "operator not confirmed stopped; uninstall goes on")
    released = release_pools(kube, None if args.all_namespaces else args.served_namespace)
    print(f"released {FINALIZER} from {released} pools")
    if not stopped:
        print(
            "the operator may still run: it puts its finalizer back on a pool it handles; "
            "check the pools after the uninstall (docs/operator.md, Uninstall)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
