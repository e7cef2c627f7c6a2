"""kmock's KubernetesEmulator with the gaps that matter to an operator filled in.

What kmock 0.8 lacks and this subclass adds (see ../shared/notes/kopf-kmock.md):
uid / generation / resourceVersion / creationTimestamp on every object; no-op writes that
change nothing (no new resourceVersion, no watch event); ``/status`` and ``/scale``
subresources with their real semantics (the main endpoint ignores status; /scale reads and
writes ``spec.replicas`` as an ``autoscaling/v1`` Scale); list resourceVersions and label
selectors; watches that subscribe before listing and resume from ``?resourceVersion=``;
finalizers and ``deletionTimestamp``; 409 Conflict for a write that carries a stale
``metadata.resourceVersion``; what the API server does to built-in objects on
every write (defaults, canonical quantities, omitempty: :mod:`.apiserver`); refusals a
test forces on one object (403, 422); a count of the writes each object received;
garbage collection by ownerReferences. Not emulated: admission/validation, server-side
apply, RBAC, controllers (Deployments never get pods).

Runs in a background thread with its own event loop, so tests stay synchronous and talk
to it over HTTP like to any API server (``EmulatorThread.kubeconfig``).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import datetime
import itertools
import json
import threading
import uuid
from pathlib import Path
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
import yaml

from tests.operator.apiserver import (
    normalise,
    parse_selector,
    refusal,
    selector_matches,
    stale_version,
)

Key = tuple[kmock.resource, str | None, str]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class ClusterEmulator(kmock.KubernetesEmulator):
    """See the module docstring."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._rv = itertools.count(1)
        self._events: list[tuple[int, Any, dict[str, Any]]] = []
        self._changed = asyncio.Condition()
        # plural -> HTTP statuses to answer the next writes of that resource with
        self.fail_next: dict[str, list[int]] = {}
        # plural -> list requests served (watches not counted)
        self.lists: collections.Counter[str] = collections.Counter()
        # (plural, name) -> HTTP status every write of that object is refused with
        self.refuse: dict[tuple[str, str], int] = {}
        # (plural, namespace, name, verb) -> write requests received (no-ops included)
        self.writes: collections.Counter[tuple[str, str | None, str, str]] = collections.Counter()

    # ---- registration -----------------------------------------------------------------

    def register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            self.resources[f"{spec['group']}/{version['name']}/{spec['names']['plural']}"] = (
                kmock.ResourceInfo(
                    kind=spec["names"]["kind"],
                    singular=spec["names"]["singular"],
                    namespaced=spec["scope"] == "Namespaced",
                    shortnames=set(spec["names"].get("shortNames", [])),
                    verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
                    subresources=set(version.get("subresources", {})),
                )
            )

    def _subresources(self, resource: Any) -> set[str]:
        try:
            return set(self.resources[resource].subresources)
        except KeyError:
            return set()

    # ---- request dispatch -------------------------------------------------------------

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        action = request.action
        if request.resource is None or request.resource.plural is None:
            return await super()._handle(request)
        try:
            if action == kmock.action.WATCH:
                return await self._watch(request)
            if action == kmock.action.LIST:
                return await self._list(request)
            if action == kmock.action.FETCH:
                return aiohttp.web.json_response(await self._fetch(request))
            if action in (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE):
                self._refused(request)
                injected = self.fail_next.get(request.resource.plural)
                if injected:
                    status = injected.pop(0)
                    raise kmock.KubernetesError(status=status, reason="Injected", message="test")
                async with self._lock:
                    result = await self._write(request)
                return aiohttp.web.json_response(result)
        except kmock.KubernetesError as e:
            return await self._render_error(e)
        return await super()._handle(request)

    def _refused(self, request: kmock.Request) -> None:
        """Count the write; raise the refusal a test set for this object, if any."""
        plural = request.resource.plural if request.resource else ""
        data = request.data if isinstance(request.data, dict) else {}
        name = request.name or data.get("metadata", {}).get("name", "")
        verbs = {kmock.action.CREATE: "create", kmock.action.DELETE: "delete"}
        verb = verbs.get(request.action or kmock.action.UPDATE, "patch")
        verb += f"/{request.subresource}" if request.subresource else ""
        namespace = request.namespace or data.get("metadata", {}).get("namespace")
        self.writes[(str(plural), namespace, str(name), verb)] += 1
        status = self.refuse.get((str(plural), str(name)))
        if status and not request.subresource:
            reason, message = refusal(status, str(plural), str(name), verb)
            raise kmock.KubernetesError(status=status, reason=reason, message=message)

    def _key(self, request: kmock.Request, name: str | None = None) -> Key:
        # Only object requests get here: a resource and a name (kmock's parsing makes them
        # FETCH/UPDATE/DELETE; a create passes the name from its body).
        resource, name = request.resource, name or request.name
        assert resource is not None and name is not None
        return (resource, request.namespace, name)

    def _get(self, key: Key) -> dict[str, Any] | None:
        try:
            obj = self._objects[key]
        except KeyError:
            return None
        return None if obj.deleted else copy.deepcopy(obj.raw)

    async def _fetch(self, request: kmock.Request) -> dict[str, Any]:
        obj = self._get(self._key(request))
        if obj is None:
            raise kmock.KubernetesObjectNotFoundError()
        if request.subresource == "scale":
            return self._scale(obj)
        return obj

    @staticmethod
    def _scale(obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion") if k in meta
            },
            "spec": {"replicas": obj.get("spec", {}).get("replicas", 0)},
            "status": {
                "replicas": obj.get("status", {}).get("replicas", 0),
                "selector": obj.get("status", {}).get("selector", ""),
            },
        }

    def _matching(self, request: kmock.Request) -> list[dict[str, Any]]:
        reqs = parse_selector(request.params.get("labelSelector", ""))
        out = []
        for (resource, namespace, _name), obj in list(self._objects.items()):
            if resource != request.resource or obj.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            raw = copy.deepcopy(obj.raw)
            if selector_matches(reqs, raw.get("metadata", {}).get("labels") or {}):
                out.append(raw)
        return out

    async def _list(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        assert request.resource is not None and request.resource.plural is not None
        self.lists[request.resource.plural] += 1
        async with self._lock:
            items = self._matching(request)
            rv = str(self._current_rv())
        return aiohttp.web.json_response(
            {
                "kind": "List",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": rv},
                "items": items,
            }
        )

    def _current_rv(self) -> int:
        return self._events[-1][0] if self._events else 0

    async def _watch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        raw_request = request._raw_request
        assert raw_request is not None  # None only for requests made in code, not over HTTP
        response = aiohttp.web.StreamResponse()
        response.content_type = "application/json"
        await response.prepare(raw_request)
        reqs = parse_selector(request.params.get("labelSelector", ""))
        since = request.params.get("resourceVersion", "")
        timeout = float(request.params.get("timeoutSeconds", "0") or 0) or None

        def wanted(event: dict[str, Any]) -> bool:
            meta = event["object"].get("metadata", {})
            if request.namespace is not None and meta.get("namespace") != request.namespace:
                return False
            if request.name is not None and meta.get("name") != request.name:
                return False
            return selector_matches(reqs, meta.get("labels") or {})

        async with self._lock:  # writes hold this lock: nothing slips between list and log
            position = len(self._events)
            if since and since != "0":
                first = [
                    e for rv, res, e in self._events if rv > int(since) and res == request.resource
                ]
            else:
                first = [{"type": "ADDED", "object": o} for o in self._matching(request)]
        try:
            async with asyncio.timeout(timeout):
                for event in first:
                    if wanted(event):
                        await response.write(json.dumps(event).encode() + b"\n")
                while True:
                    seen = position

                    def grown(seen: int = seen) -> bool:
                        return len(self._events) > seen

                    async with self._changed:
                        await self._changed.wait_for(grown)
                        batch = self._events[position:]
                        position = len(self._events)
                    for _rv, res, event in batch:
                        if res == request.resource and wanted(event):
                            await response.write(json.dumps(event).encode() + b"\n")
        except (TimeoutError, ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    # ---- writes -----------------------------------------------------------------------

    async def _emit(self, resource: Any, type_: str, obj: dict[str, Any]) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self._events.append((rv, resource, {"type": type_, "object": copy.deepcopy(obj)}))
        async with self._changed:
            self._changed.notify_all()

    async def _write(self, request: kmock.Request) -> dict[str, Any]:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        plural = str(request.resource.plural if request.resource else "")
        if request.action == kmock.action.CREATE:
            body = copy.deepcopy(request.data)
            meta = body.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            namespace = request.namespace or meta.get("namespace")
            key = self._key(
                kmock.Request(resource=request.resource, namespace=namespace), meta["name"]
            )
            if self._get(key) is not None:
                raise kmock.KubernetesError(
                    status=409, reason="AlreadyExists", message=meta["name"]
                )
            if namespace:
                meta["namespace"] = namespace
            body = normalise(plural, body, None)
            meta = body["metadata"]
            meta.update(
                uid=str(uuid.uuid4()),
                generation=1,
                creationTimestamp=now,
                resourceVersion=str(next(self._rv)),
            )
            if key in self._objects:
                self._objects[key].create(body)
            else:
                self._objects[key] = body
            await self._emit(request.resource, "ADDED", body)
            return body

        key = self._key(request)
        before = self._get(key)
        if before is None:
            raise kmock.KubernetesObjectNotFoundError()

        if request.action == kmock.action.DELETE:
            if before["metadata"].get("finalizers"):
                if before["metadata"].get("deletionTimestamp"):
                    return before
                after = copy.deepcopy(before)
                after["metadata"]["deletionTimestamp"] = now
                return await self._store(request.resource, key, before, after)
            self._objects[key].delete()
            before["metadata"]["resourceVersion"] = str(next(self._rv))
            await self._emit(request.resource, "DELETED", before)
            await self._collect_garbage(key[1])
            return before

        patch = request.data
        sub = request.subresource
        # Optimistic concurrency as the API server has it: a stale version is a 409.
        conflict = stale_version(plural, key[0].group or "", key[2], before, patch)
        if conflict:
            raise kmock.KubernetesError(status=409, reason="Conflict", message=conflict)
        if sub == "scale":
            replicas = (patch or {}).get("spec", {}).get("replicas")
            after = merge_patch(before, {"spec": {"replicas": replicas}})
        else:
            try:
                patched = (
                    jsonpatch.apply_patch(before, patch)
                    if isinstance(patch, list)
                    else merge_patch(before, patch)
                )
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                # As the API server: a failed "test" (stale resourceVersion) is a 422.
                raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from e
            if sub == "status":
                after = {**before, "status": patched.get("status")}
                if after["status"] is None:
                    del after["status"]
            else:
                after = normalise(plural, patched, before)
                if "status" in self._subresources(request.resource):
                    after.pop("status", None)  # the main endpoint ignores status
                    if "status" in before:
                        after["status"] = before["status"]
        stored = await self._store(request.resource, key, before, after)
        return self._scale(stored) if sub == "scale" else stored

    async def _store(
        self, resource: Any, key: Key, before: dict[str, Any], after: dict[str, Any]
    ) -> dict[str, Any]:
        meta, old = after.setdefault("metadata", {}), before["metadata"]
        for field in (
            "uid",
            "creationTimestamp",
            "name",
            "namespace",
            "generation",
            "resourceVersion",
        ):
            if field in old:
                meta[field] = old[field]
        if old.get("deletionTimestamp"):
            meta["deletionTimestamp"] = old["deletionTimestamp"]
        if after == before:
            return before  # no-op: no new resourceVersion, no event (as the API server)
        spec_of = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
        if spec_of(after) != spec_of(before):
            meta["generation"] = int(old.get("generation", 1)) + 1
        meta["resourceVersion"] = str(next(self._rv))
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._objects[key].delete()
            await self._emit(resource, "DELETED", after)
            await self._collect_garbage(key[1])
            return after
        self._objects[key].patch(None)  # new history entry, then replace its content
        version = self._objects[key].last
        version.clear()
        version.update(after)
        await self._emit(resource, "MODIFIED", after)
        return after

    async def _collect_garbage(self, namespace: str | None) -> None:
        """kube-controller-manager's garbage collector, background propagation: an object
        whose ownerReferences all name objects that no longer exist is deleted (objects
        with finalizers are not emulated here), and so on down the chain."""
        live = {o.raw["metadata"].get("uid") for o in self._objects.values() if not o.deleted}
        orphans = [
            (key, obj)
            for key, obj in list(self._objects.items())
            if key[1] == namespace
            and not obj.deleted
            and (owners := obj.raw["metadata"].get("ownerReferences"))
            and not any(r.get("uid") in live for r in owners)
        ]
        for key, obj in orphans:
            gone = copy.deepcopy(obj.raw)
            obj.delete()
            gone["metadata"]["resourceVersion"] = str(next(self._rv))
            await self._emit(key[0], "DELETED", gone)
        if orphans:
            await self._collect_garbage(namespace)


class EmulatorThread:
    """Runs a ClusterEmulator + kmock.Server in a thread; ``url`` once started."""

    def __init__(self, crd_paths: list[Path]) -> None:
        self.crds = [d for p in crd_paths for d in yaml.safe_load_all(p.read_text()) if d]
        self.emulator: ClusterEmulator | None = None
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="kmock", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # surfaced by start()
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        emulator = ClusterEmulator()
        emulator.resources.load_bundled()
        for crd in self.crds:
            emulator.register_crd(crd)
        async with emulator, kmock.Server(emulator) as server:
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def start(self) -> EmulatorThread:
        self._thread.start()
        self._ready.wait(30)
        if self._error or not self.url:
            raise RuntimeError(f"emulator did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def fail_next_writes(self, plural: str, *statuses: int) -> None:
        """Answer the next writes of one resource with these error statuses."""
        assert self.emulator is not None
        self.emulator.fail_next.setdefault(plural, []).extend(statuses)

    def refuse_writes(self, plural: str, name: str, status: int | None) -> None:
        """Refuse every write of one object (not its /status) with 403 or 422 as the API
        server words them, until called again with ``status`` None."""
        assert self.emulator is not None
        if status is None:
            self.emulator.refuse.pop((plural, name), None)
        else:
            self.emulator.refuse[(plural, name)] = status

    def write_count(self, plural: str, namespace: str, verbs: tuple[str, ...] = ()) -> int:
        """Write requests one namespace's objects of a resource received so far (no-op
        patches included); only ``verbs`` (create, patch, delete, patch/status ...) if given."""
        assert self.emulator is not None
        return sum(
            n
            for (p, ns, _name, verb), n in self.emulator.writes.items()
            if p == plural and ns == namespace and (not verbs or verb in verbs)
        )

    def list_count(self, plural: str) -> int:
        """How many list requests (not watches) of one resource were served so far."""
        assert self.emulator is not None
        return self.emulator.lists[plural]

    def write_kubeconfig(self, path: Path) -> Path:
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
                    "users": [{"name": "kmock", "user": {}}],
                    "contexts": [
                        {"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}
                    ],
                    "current-context": "kmock",
                }
            )
        )
        return path
