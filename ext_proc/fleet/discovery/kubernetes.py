"""A pool's instances from the Kubernetes API: the Ready pods of an InferencePool or a selector.

Who is a member is what llm-d's EPP decides (llm-d-router `pkg/epp/controller/pod_reconciler.go`,
`pkg/epp/util/pod/pod.go`; shared/docs/elastic-fleet-and-flow-control.md §3), so that tito and
an llm-d deployment agree on the same pods: a pod of `namespace` matching the selector (an
InferencePool's `spec.selector.matchLabels`, or `selector`) that is Ready (condition `Ready`
is "True"), not being deleted (no `deletionTimestamp`: a terminating pod can still read Ready
while the kubelet stops it, and should take no new request) and has a pod IP. Each such pod is
one instance per target port (the pool's `spec.targetPorts`, or `port`), as llm-d makes one
endpoint per rank; llm-d's annotation `llm-d.ai/active-ports` (legacy
`inference.networking.k8s.io/active-ports`), a comma list, keeps only the target ports it
names live. tito adds one filter of its own: a P/D pool takes only the pods whose role label
(`llm-d.ai/role`) says its role (`DiscoveryConfig.serves`).

Pods, and the InferencePool, are followed with list + watch, as client-go's reflector does
(llm-d relies on it; here it is written out): a list gives the objects and a resourceVersion,
a watch from it the changes (bookmarks asked for, so a quiet watch still moves the version
on); a watch ends after `WATCH_TIMEOUT_S` and resumes from the last version seen. A dropped
connection or any other failure backs off (0.5 s doubling to 10 s) and resumes the watch from
that version, keeping the last membership published. A 410 Gone (the version was compacted
away) relists: the fresh list replaces what was kept, so a pod deleted in the gap disappears,
though its DELETED event was never seen. A pool whose selector or target ports change
restarts the pods' list + watch; a pool that does not exist has no instances.

Least privilege: a Role with get, list and watch on `pods` (core) and `inferencepools`
(`inference.networking.k8s.io`) in `namespace`, and nothing else.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config

from ext_proc.config_discovery import DiscoveryConfig
from ext_proc.fleet.discovery import Found, Publish

log = logging.getLogger("tito.discovery")

POOL_API = ("inference.networking.k8s.io", "v1", "inferencepools")  # group, version, plural
ACTIVE_PORTS = ("llm-d.ai/active-ports", "inference.networking.k8s.io/active-ports")  # llm-d's, its legacy one
WATCH_TIMEOUT_S = 300  # the server ends each watch after this; it resumes from the last version
# A list is one answer; a watch is silent for as long as nothing changes, but no longer than
# its own timeout (a read timeout a little past it catches a connection that died silently).
LIST_TIMEOUT = aiohttp.ClientTimeout(total=60, sock_connect=10)
WATCH_TIMEOUT = aiohttp.ClientTimeout(sock_connect=10, sock_read=WATCH_TIMEOUT_S + 30)
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 10.0

Obj = dict[str, Any]
Objects = dict[str, Obj]  # by metadata.name
OnUpdate = Callable[[Objects, bool], None]  # what is kept now, and whether a (re)list made it
Fetch = Callable[..., Awaitable[Any]]  # a list call, given its query (its aiohttp response: no preloading)


class Expired(Exception):
    """410 Gone: the resourceVersion is older than the server keeps (relist)."""


class Refused(Exception):
    """Any other answer than the one asked for (an error status, a malformed event)."""


# What the API server or the way to it can do wrong: none of it ends the source.
TROUBLE = (aiohttp.ClientError, OSError, TimeoutError, ValueError, Refused, config.ConfigException)


class KubernetesSource:
    def __init__(self, settings: DiscoveryConfig, role: str) -> None:
        self.settings = settings
        self._role = role

    async def run(self, publish: Publish) -> None:
        api = await self._connect()
        try:
            members = Members(publish)
            if self.settings.inference_pool is None:
                await self.follow_pods(api, Target.of(self.settings.selector, [self.settings.port]), members)
            else:
                await PoolFollower(self, api, members).run()
        finally:
            await api.close()

    async def _connect(self) -> client.ApiClient:
        """An API client, once the configuration is there (a token file may come late)."""
        backoff = Backoff()
        while True:
            try:
                return client.ApiClient(await self._configuration())
            except TROUBLE as exc:
                log.warning("kubernetes discovery: cannot configure the API client (%s); retrying", exc)
                await backoff.pause()

    async def _configuration(self) -> client.Configuration:
        settings = self.settings
        configuration = client.Configuration()
        if settings.api_url is not None:
            configuration.host = settings.api_url
            if settings.token_file is not None:
                read_token(settings.token_file, configuration)
                # A projected service-account token rotates: read it again for every request.
                configuration.refresh_api_key_hook = partial(read_token, settings.token_file)
            return configuration
        try:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except config.ConfigException:  # not in a cluster: the kubeconfig's current context
            await config.load_kube_config(client_configuration=configuration, persist_config=False)
        return configuration

    async def follow_pods(self, api: client.ApiClient, target: Target, members: Members) -> None:
        fetch = partial(
            client.CoreV1Api(api).list_namespaced_pod,
            self.settings.namespace,
            label_selector=target.selector,
            _preload_content=False,
        )

        def update(pods: Objects, relisted: bool) -> None:
            found = (instance for pod in pods.values() for instance in self._instances(pod, target.ports))
            members.offer(frozenset(found), relisted)

        await Reflector(f"pods {target.selector!r}", fetch, update).run()

    def _instances(self, pod: Obj, ports: tuple[int, ...]) -> list[Found]:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ip = status.get("podIP")
        role = (meta.get("labels") or {}).get(self.settings.role_label)
        if not ip or meta.get("deletionTimestamp") or not ready(status) or not self.settings.serves(self._role, role):
            return []
        host = f"[{ip}]" if ":" in ip else ip
        return [Found(host, port) for port in active_ports(meta.get("annotations") or {}, ports)]

    def pool_fetch(self, api: client.ApiClient) -> Fetch:
        return partial(
            client.CustomObjectsApi(api).list_namespaced_custom_object,
            *POOL_API[:2],
            self.settings.namespace,
            POOL_API[2],
            field_selector=f"metadata.name={self.settings.inference_pool}",
            _preload_content=False,
        )


class PoolFollower:
    """An InferencePool's pods: its list + watch decides what the pods' list + watch selects."""

    def __init__(self, source: KubernetesSource, api: client.ApiClient, members: Members) -> None:
        self._source, self._api, self._members = source, api, members
        self._name = f"{source.settings.namespace}/{source.settings.inference_pool}"
        self._target: Target | None = None
        self._pods: asyncio.Task[None] | None = None

    async def run(self) -> None:
        try:
            await Reflector(f"inferencepool {self._name}", self._source.pool_fetch(self._api), self._update).run()
        finally:
            await self._stop_pods()

    def _update(self, pools: Objects, relisted: bool) -> None:
        pool = next(iter(pools.values()), None)  # the field selector leaves only the one named
        target = None if pool is None else Target.of_pool(pool)
        if target is None:
            if self._target is not None or relisted:
                log.warning("kubernetes discovery: InferencePool %s does not exist: no instances", self._name)
            self._restart(None)
            self._members.offer(frozenset(), relisted)
        elif target != self._target:
            self._restart(target)

    def _restart(self, target: Target | None) -> None:
        # The old pods' list + watch is cancelled before the new one starts: it is woken only
        # by the cancellation, at the await it waits on, so it publishes nothing more.
        if self._pods is not None:
            self._pods.cancel()
        self._target = target
        self._pods = None
        if target is not None:
            self._pods = asyncio.create_task(self._source.follow_pods(self._api, target, self._members))

    async def _stop_pods(self) -> None:
        if self._pods is not None:
            self._pods.cancel()
            await asyncio.wait([self._pods])


class Reflector:
    """One collection kept by list + watch: its objects by name, and the resourceVersion to
    resume from. `on_update` hears of every change, and of every (re)list.

    The watch is the API's own call with `watch=True` and `_preload_content=False`, its lines
    read here, rather than kubernetes_asyncio's `Watch().stream`: that one retries a 410 once
    by itself (only when no timeout is given) before raising it, builds a model of every
    object, and opens an ApiClient of its own with the default configuration. Here a 410 is
    always a relist, a bookmark moves the version and nothing else, and the raw JSON is read."""

    def __init__(self, what: str, fetch: Fetch, on_update: OnUpdate) -> None:
        self._what = what
        self._fetch = fetch
        self._on_update = on_update
        self._objects: Objects = {}
        self._version: str | None = None  # None: (re)list first
        self._watches = 0  # watches started since the last list
        self._backoff = Backoff()
        self._failing = ""  # the trouble last warned of ("": none since the last success)

    async def run(self) -> None:
        while True:
            try:
                if self._version is None:
                    await self._list()
                if await self._watch():
                    continue  # it ran to its timeout: resume at once
            except Expired as exc:
                # The first watch after a list told its version is gone: the server's trouble,
                # not a gap (back off rather than relist in a tight loop).
                relist_now = self._watches > 1
                self._version = None
                if relist_now:
                    log.info("kubernetes discovery: %s: %s; relisting", self._what, exc)
                    continue
                self._warn(f"{self._what}: the listed resourceVersion expired at once")
            except TROUBLE as exc:
                self._warn(f"{self._what}: {type(exc).__name__}: {exc}")
            await self._backoff.pause()

    async def _list(self) -> None:
        response: aiohttp.ClientResponse = await self._fetch(_request_timeout=LIST_TIMEOUT)
        async with response:
            body = await answer(response)
        try:
            items, version = body.get("items") or [], body["metadata"]["resourceVersion"]
            self._objects = {item["metadata"]["name"]: item for item in items}
        except (KeyError, TypeError, AttributeError) as exc:
            raise Refused(f"malformed list: {exc!r}") from None
        self._version, self._watches = version, 0
        self._succeeded()
        self._on_update(self._objects, True)

    async def _watch(self) -> bool:
        """Follow one watch; whether it ended by itself having delivered anything (one that
        ends at once with nothing is treated as trouble: no reconnecting in a tight loop)."""
        self._watches += 1
        response: aiohttp.ClientResponse = await self._fetch(
            watch=True,
            resource_version=self._version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_S,
            _request_timeout=WATCH_TIMEOUT,
        )
        try:
            if response.status != 200:
                await answer(response)
            self._succeeded()
            delivered = False
            async for line in response.content:  # one JSON event a line
                if line.strip():
                    self._apply(json.loads(line))
                    delivered = True
            return delivered
        finally:
            response.close()

    def _apply(self, event: Any) -> None:
        if not isinstance(event, dict):
            raise Refused(f"a watch event expected, not {event!r:.80}")
        kind = event.get("type")
        obj: Any = event.get("object")  # as the server sent it: checked as it is read
        if kind == "ERROR":
            raise failure(obj)
        try:
            version, name = obj["metadata"]["resourceVersion"], obj["metadata"].get("name")
        except (KeyError, TypeError) as exc:
            raise Refused(f"malformed {kind} event: {exc!r}") from None
        self._version = version
        if kind == "BOOKMARK":
            return  # only the version moves on
        if kind == "DELETED":
            self._objects.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            self._objects[name] = obj
        else:
            raise Refused(f"unknown watch event {kind!r}")
        self._on_update(self._objects, False)

    def _warn(self, trouble: str) -> None:
        if trouble != self._failing:  # once per kind of trouble, not once per retry
            log.warning("kubernetes discovery: %s; keeping the last membership, retrying", trouble)
        self._failing = trouble

    def _succeeded(self) -> None:
        if self._failing:
            log.info("kubernetes discovery: %s: the API server answers again", self._what)
        self._failing = ""
        self._backoff.reset()


class Members:
    """Publishes a pool's membership when it changes, and after every relist (so there is a
    first publication, empty or not)."""

    def __init__(self, publish: Publish) -> None:
        self._publish = publish
        self._last: frozenset[Found] | None = None

    def offer(self, members: frozenset[Found], relisted: bool) -> None:
        if relisted or members != self._last:
            self._last = members
            self._publish(members)


@dataclass(frozen=True)
class Target:
    """What selects a pool's pods (a label selector) and the ports each of them serves."""

    selector: str
    ports: tuple[int, ...]

    @staticmethod
    def of(match_labels: dict[str, str], ports: list[int]) -> Target:
        selector = ",".join(f"{key}={value}" for key, value in sorted(match_labels.items()))
        return Target(selector, tuple(sorted(set(ports))))

    @staticmethod
    def of_pool(pool: Obj) -> Target:
        spec = pool.get("spec") or {}
        match_labels = (spec.get("selector") or {}).get("matchLabels") or {}
        ports = [port["number"] for port in spec.get("targetPorts") or [] if isinstance(port.get("number"), int)]
        return Target.of(match_labels, ports)


class Backoff:
    def __init__(self) -> None:
        self._next = BACKOFF_MIN_S

    def reset(self) -> None:
        self._next = BACKOFF_MIN_S

    async def pause(self) -> None:
        await asyncio.sleep(self._next)
        self._next = min(self._next * 2, BACKOFF_MAX_S)


def ready(status: Obj) -> bool:
    """llm-d's IsPodReady, less the deletionTimestamp: the `Ready` condition is "True"."""
    conditions = status.get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def active_ports(annotations: dict[str, str], ports: tuple[int, ...]) -> tuple[int, ...]:
    """llm-d's ExtractActivePorts: no annotation, every target port; else those it lists (an
    entry that is no target port, or no number, counts for nothing)."""
    listed = annotations.get(ACTIVE_PORTS[0], annotations.get(ACTIVE_PORTS[1]))
    if listed is None:
        return ports
    named = {int(entry) for entry in listed.split(",") if entry.strip().isdigit()}
    return tuple(port for port in ports if port in named)


async def answer(response: aiohttp.ClientResponse) -> Obj:
    """A response's JSON body if it is a success, else its Status as an exception."""
    if response.status == 200:
        body = await response.json(content_type=None)
        if not isinstance(body, dict):
            raise Refused("a JSON object expected")
        return body
    try:
        status = json.loads(await response.read())
    except ValueError:
        status = {"code": response.status, "message": response.reason}
    raise failure(status if isinstance(status, dict) else {"code": response.status})


def failure(status: Any) -> Exception:
    """A Status (an ERROR event's object, or an error answer's body) as what to do about it."""
    status = status if isinstance(status, dict) else {}
    if status.get("code") == 410:
        return Expired(status.get("message"))
    return Refused(f"{status.get('code')} {status.get('reason')}: {status.get('message')}")


def read_token(path: str, configuration: client.Configuration) -> None:
    configuration.api_key["BearerToken"] = "Bearer " + Path(path).read_text().strip()
