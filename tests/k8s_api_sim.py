"""A Kubernetes API-server simulator: Pods and InferencePools, listed and watched, on the wire.

For the Kubernetes membership source (`ext_proc/fleet/discovery/kubernetes.py`), what a real
API server does on cue, in-process and in milliseconds: readiness flips, relabels, graceful
and plain deletions, bookmarks, compaction (a 410 for a watch from a too-old resourceVersion),
dropped watch connections, and being down. It speaks exactly what the source uses:

- `GET /api/v1/namespaces/{ns}/pods` and
  `GET /apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools`, with
  `labelSelector` (equality and existence terms: `k=v`, `k==v`, `k!=v`, `k`, `!k`) and
  `fieldSelector` (`metadata.name`, `metadata.namespace`): a `PodList` / `InferencePoolList`
  whose `metadata.resourceVersion` is the current one. As the real server's, a built-in
  type's list items carry no `apiVersion`/`kind`, a custom resource's do.
- the same with `watch=1|true` (Go's ParseBool), `resourceVersion`, `allowWatchBookmarks`,
  `timeoutSeconds`: HTTP 200, chunked, one JSON event a line. From resourceVersion N: every
  change after N, then live ones; from none or "0": an ADDED per object, then live ones.
  Under a label selector a change is seen as the watch cache shows it: an object that
  starts matching is ADDED, one that stops matching is DELETED. A too-old N (below the mark
  `compact()` sets) gets one `ERROR` event carrying a 410 `Expired` Status, then the end.
  The watch ends cleanly after `timeoutSeconds` (default 1800, the server's own timeout).

One resourceVersion counter across every object (etcd's revision). Not simulated: paging
(`limit`/`continue`), set-based selectors, other resources and verbs, authentication (the
`Authorization` header is only recorded), the bookmarks a real server sends on its own
(only `send_bookmarks()` sends them), and a "too large resource version" wait.

The controls are plain methods, for the test's own event loop (the server runs in it too).
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any

from aiohttp import web

Obj = dict[str, Any]
Matches = Callable[[Obj], bool]

POOL_GROUP_VERSION = "inference.networking.k8s.io/v1"
# Go's strconv.ParseBool, which the API server parses `watch` and `allowWatchBookmarks` with.
TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
DEFAULT_WATCH_TIMEOUT_S = 1800.0  # the API server's --min-request-timeout
DROP, END = "drop", "end"  # what a watch's queue says besides events


@dataclass(frozen=True)
class Kind:
    plural: str
    api_version: str
    kind: str
    typed_items: bool  # list items carry apiVersion/kind (custom resources) or not (built-in types)


PODS = Kind("pods", "v1", "Pod", typed_items=False)
POOLS = Kind("inferencepools", POOL_GROUP_VERSION, "InferencePool", typed_items=True)


@dataclass(frozen=True)
class Change:
    rv: int
    type: str  # ADDED | MODIFIED | DELETED
    obj: Obj  # after the change (DELETED: the last state, at the deletion's resourceVersion)
    prev: Obj | None  # before it (MODIFIED, DELETED)


@dataclass
class Watcher:
    kind: Kind
    matches: Matches  # its namespace, label and field selectors
    bookmarks: bool
    queue: asyncio.Queue[Obj | str] = field(default_factory=asyncio.Queue)


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def terms(text: str) -> list[str]:
    return [term.strip() for term in text.split(",") if term.strip()]


def label_selector(text: str) -> Matches:
    """Equality- and existence-based requirements, ANDed (set-based ones are a 400 here)."""
    requirements = [label_requirement(term) for term in terms(text)]
    return lambda obj: all(holds(r, obj["metadata"].get("labels") or {}) for r in requirements)


def label_requirement(term: str) -> tuple[str, str, str]:
    """(key, operator, value); operators `=`, `!=`, `exists`, `!exists`."""
    if "(" in term or " " in term:
        raise ValueError(f"unable to parse requirement: set-based selectors are not simulated: {term!r}")
    if "!=" in term:
        key, value = term.split("!=", 1)
        return key, "!=", value
    if "=" in term:
        key, value = term.replace("==", "=", 1).split("=", 1)
        return key, "=", value
    return (term[1:], "!exists", "") if term.startswith("!") else (term, "exists", "")


def holds(requirement: tuple[str, str, str], labels: dict[str, str]) -> bool:
    key, operator, value = requirement
    if operator == "=":
        return labels.get(key) == value
    if operator == "!=":
        return labels.get(key) != value
    return (key in labels) == (operator == "exists")


def field_selector(text: str) -> Matches:
    """`metadata.name` and `metadata.namespace`, with `=`, `==` or `!=`, ANDed."""
    requirements = [field_requirement(term) for term in terms(text)]
    return lambda obj: all((obj["metadata"][key] == value) != negated for key, value, negated in requirements)


def field_requirement(term: str) -> tuple[str, str, bool]:
    negated = "!=" in term
    path, value = term.replace("!=", "=", 1).replace("==", "=", 1).split("=", 1)
    if path not in ("metadata.name", "metadata.namespace"):
        raise ValueError(f'field label not supported: "{path}"')
    return path.removeprefix("metadata."), value, negated


def seen_as(change: Change, matches: Matches) -> str | None:
    """The event a watch under a selector gets for a change (the watch cache's filtering)."""
    if change.type == "DELETED":
        return "DELETED" if matches(change.obj) else None
    now_in, was_in = matches(change.obj), change.prev is not None and matches(change.prev)
    if now_in:
        return "MODIFIED" if was_in else "ADDED"
    return "DELETED" if was_in else None


def line(event: Obj) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


class K8sApiSim:
    def __init__(self, namespace: str = "default") -> None:
        self.namespace = namespace
        self.port = 0
        # What the tests read: requests served by plural, the last watch's query by plural,
        # the last Authorization header.
        self.lists_served: Counter[str] = Counter()
        self.watches_served: Counter[str] = Counter()
        self.last_watch: dict[str, dict[str, str]] = {}
        self.authorization: str | None = None
        self._rv = 0
        self._compacted = 0  # a watch from below this resourceVersion is answered 410
        self._objects: dict[str, dict[tuple[str, str], Obj]] = {PODS.plural: {}, POOLS.plural: {}}
        self._history: list[Change] = []
        self._watchers: list[Watcher] = []
        self._runner: web.AppRunner | None = None

    # -- the server

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> K8sApiSim:
        """Listen on 127.0.0.1 (an ephemeral port, or the one it had: a restart)."""
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", partial(self._serve, kind=PODS))
        app.router.add_get(
            f"/apis/{POOL_GROUP_VERSION}/namespaces/{{namespace}}/inferencepools", partial(self._serve, kind=POOLS)
        )
        self._runner = web.AppRunner(app, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        """Down: open watches drop, connections are refused (objects and history are kept)."""
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _serve(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        self.authorization = request.headers.get("Authorization")
        namespace = request.match_info["namespace"]
        try:
            labels = label_selector(request.query.get("labelSelector", ""))
            fields = field_selector(request.query.get("fieldSelector", ""))
        except ValueError as exc:
            return web.json_response(status(400, "BadRequest", str(exc)), status=400)

        def matches(obj: Obj) -> bool:
            return obj["metadata"]["namespace"] == namespace and labels(obj) and fields(obj)

        if request.query.get("watch", "") in TRUE:
            return await self._watch(request, kind, matches)
        self.lists_served[kind.plural] += 1
        items = [self._listed(kind, obj) for obj in self._objects[kind.plural].values() if matches(obj)]
        return web.json_response(
            {
                "kind": f"{kind.kind}List",
                "apiVersion": kind.api_version,
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }
        )

    @staticmethod
    def _listed(kind: Kind, obj: Obj) -> Obj:
        return obj if kind.typed_items else {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}

    async def _watch(self, request: web.Request, kind: Kind, matches: Matches) -> web.StreamResponse:
        self.watches_served[kind.plural] += 1
        self.last_watch[kind.plural] = dict(request.query)
        since = request.query.get("resourceVersion", "")
        timeout = float(request.query.get("timeoutSeconds") or DEFAULT_WATCH_TIMEOUT_S)
        bookmarks = request.query.get("allowWatchBookmarks", "") in TRUE
        # The backlog and the registration happen with no await between them: no change is
        # missed or sent twice.
        if since not in ("", "0") and int(since) < self._compacted:
            backlog = [{"type": "ERROR", "object": self._expired(int(since))}]
            watcher = None
        else:
            backlog = self._backlog(kind, since, matches)
            watcher = Watcher(kind, matches, bookmarks)
            self._watchers.append(watcher)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            for event in backlog:
                await response.write(line(event))
            if watcher is None or await self._stream(watcher, response, timeout) == END:
                await response.write_eof()
            elif request.transport is not None:  # dropped (unless the server's shutdown closed it)
                request.transport.abort()  # no terminating chunk: the client sees a broken stream
        except ConnectionResetError:
            pass  # the client went away (as one does that stops watching)
        finally:
            if watcher in self._watchers:
                self._watchers.remove(watcher)
        return response

    async def _stream(self, watcher: Watcher, response: web.StreamResponse, timeout: float) -> str:
        """Live events until the watch times out (END), is ended (END) or dropped (DROP)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    event = await watcher.queue.get()
            except TimeoutError:
                return END
            if isinstance(event, str):
                return event
            await response.write(line(event))

    def _backlog(self, kind: Kind, since: str, matches: Matches) -> list[Obj]:
        if since in ("", "0"):  # "start at most recent": the current state as ADDED events
            current = [obj for obj in self._objects[kind.plural].values() if matches(obj)]
            return [{"type": "ADDED", "object": copy.deepcopy(obj)} for obj in current]
        events = []
        for change in self._history:
            seen = seen_as(change, matches) if change.rv > int(since) and change.obj["kind"] == kind.kind else None
            if seen is not None:
                events.append({"type": seen, "object": copy.deepcopy(change.obj)})
        return events

    def _expired(self, since: int) -> Obj:
        return status(410, "Expired", f"too old resource version: {since} ({self._compacted})")

    # -- changes

    def _commit(self, kind: Kind, type_: str, obj: Obj, prev: Obj | None) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if type_ == "DELETED":
            del self._objects[kind.plural][key]
        else:
            self._objects[kind.plural][key] = obj
        change = Change(self._rv, type_, copy.deepcopy(obj), prev)
        self._history.append(change)
        for watcher in self._watchers:
            seen = seen_as(change, watcher.matches) if watcher.kind == kind else None
            if seen is not None:
                watcher.queue.put_nowait({"type": seen, "object": copy.deepcopy(change.obj)})

    def _modify(self, kind: Kind, name: str, change: Callable[[Obj], None]) -> None:
        prev = self._objects[kind.plural][(self.namespace, name)]
        obj = copy.deepcopy(prev)
        change(obj)
        self._commit(kind, "MODIFIED", obj, prev)

    def _delete(self, kind: Kind, name: str) -> None:
        prev = self._objects[kind.plural][(self.namespace, name)]
        self._commit(kind, "DELETED", copy.deepcopy(prev), prev)

    # -- the test's controls

    def add_pod(
        self,
        name: str,
        ip: str,
        labels: dict[str, str],
        ready: bool = True,
        annotations: dict[str, str] | None = None,
    ) -> None:
        """A scheduled, running pod (Ready or not) with `ip` as its podIP."""
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": now(),
                "labels": dict(labels),
                "annotations": dict(annotations or {}),
            },
            "spec": {
                "containers": [{"name": "vllm", "image": "vllm/vllm-openai", "ports": [{"containerPort": 8000}]}],
                "nodeName": "node-1",
            },
            "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "conditions": []},
        }
        set_conditions(pod, ready)
        self._commit(PODS, "ADDED", pod, None)

    def set_ready(self, name: str, ready: bool) -> None:
        self._modify(PODS, name, lambda pod: set_conditions(pod, ready))

    def set_labels(self, name: str, labels: dict[str, str]) -> None:
        self._modify(PODS, name, lambda pod: pod["metadata"].__setitem__("labels", dict(labels)))

    def delete_pod(self, name: str, graceful: bool = False) -> None:
        """graceful: the DELETE with a grace period, which only sets deletionTimestamp (the pod
        stays, maybe still Ready, while the kubelet stops it); else the pod is gone (a second
        call ends a graceful deletion)."""
        if graceful:
            self._modify(PODS, name, mark_deleting)
        else:
            self._delete(PODS, name)

    def put_inference_pool(self, name: str, match_labels: dict[str, str], ports: list[int]) -> None:
        """Create or replace an InferencePool (its spec as the API server stores it, defaults in)."""
        spec = {
            "selector": {"matchLabels": dict(match_labels)},
            "targetPorts": [{"number": port} for port in ports],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": f"{name}-epp",
                "port": {"number": 9002},
                "failureMode": "FailClose",
            },
        }
        key = (self.namespace, name)
        if key in self._objects[POOLS.plural]:
            self._modify(POOLS, name, lambda pool: update_spec(pool, spec))
            return
        pool = {
            "apiVersion": POOL_GROUP_VERSION,
            "kind": "InferencePool",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "uid": str(uuid.uuid4()),
                "generation": 1,
                "creationTimestamp": now(),
            },
            "spec": spec,
            "status": {},
        }
        self._commit(POOLS, "ADDED", pool, None)

    def pods(self) -> dict[str, Obj]:
        """The namespace's pods as stored now, by name (copies: for reading only)."""
        return {
            name: copy.deepcopy(pod) for (ns, name), pod in self._objects[PODS.plural].items() if ns == self.namespace
        }

    def delete_inference_pool(self, name: str) -> None:
        self._delete(POOLS, name)

    def bump(self) -> int:
        """Another object changes (a resource nobody here watches): the revision moves on."""
        self._rv += 1
        return self._rv

    def send_bookmarks(self) -> int:
        """A BOOKMARK at the current resourceVersion to every watch that asked for them."""
        for watcher in self._watchers:
            if watcher.bookmarks:
                bookmark = {"kind": watcher.kind.kind, "apiVersion": watcher.kind.api_version}
                watcher.queue.put_nowait(
                    {"type": "BOOKMARK", "object": {**bookmark, "metadata": {"resourceVersion": str(self._rv)}}}
                )
        return self._rv

    def compact(self) -> None:
        """etcd compacts: a watch from any resourceVersion before the current one gets a 410."""
        self._compacted = self._rv

    def drop_watches(self) -> None:
        """Every open watch connection breaks (after what it was already sent) mid-stream."""
        self._close_watches(DROP)

    def end_watches(self) -> None:
        """Every open watch ends cleanly, as at its timeoutSeconds (after what it was sent)."""
        self._close_watches(END)

    def _close_watches(self, how: str) -> None:
        for watcher in self._watchers:
            watcher.queue.put_nowait(how)
        self._watchers.clear()


def set_conditions(pod: Obj, ready: bool) -> None:
    value = "True" if ready else "False"
    at = now()
    pod["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": at},
        {"type": "Initialized", "status": "True", "lastTransitionTime": at},
        {"type": "ContainersReady", "status": value, "lastTransitionTime": at},
        {"type": "Ready", "status": value, "lastTransitionTime": at},
    ]


def mark_deleting(pod: Obj) -> None:
    pod["metadata"]["deletionTimestamp"] = now()
    pod["metadata"]["deletionGracePeriodSeconds"] = 30


def update_spec(pool: Obj, spec: Obj) -> None:
    pool["spec"] = spec
    pool["metadata"]["generation"] += 1
