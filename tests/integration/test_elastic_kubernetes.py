"""Kubernetes-discovered pools through real parts: the Kubernetes API-server simulator
(tests/k8s_api_sim.py, on a thread of its own) lists and watches pods and an InferencePool, a
real Envoy and processor serve, engine simulators on their own loopback addresses (one port:
pod IPs) join and leave as their pods become Ready, NotReady, deleted, relabelled, or as the
InferencePool's selector and target ports change. Envoy follows the endpoints file the
processor writes. A second gateway discovers a prefill and a decode pool from the same
selector by llm-d's role label."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import pytest

from tests.conftest import RunningStack, SimGateway, free_port, start_discovered_gateway
from tests.engine_sim import EngineSim, SimServer
from tests.k8s_api_sim import K8sApiSim

NAMESPACE = "llm"
POOL = "tiny-pool"
A = {"app": "vllm-a"}  # the InferencePool's selector
B = {"app": "vllm-b"}  # other pods (the selector after the change)
OTHER = {"app": "other"}
PD = {"app": "vllm-pd"}  # the P/D gateway's selector
ROLE = "llm-d.ai/role"
FLAP = {"flap_hold_s": 0.5, "flap_hold_max_s": 1.0}  # the tests take the same pods in and out
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "which pod?"}], "max_tokens": 4}

T = TypeVar("T")


class ApiServer:
    """The API-server simulator on a background thread with its own event loop; its controls
    run there (they notify watches, whose queues belong to that loop)."""

    def __init__(self, namespace: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="k8s-api-sim", daemon=True)
        self._thread.start()
        self.sim = K8sApiSim(namespace)
        self._run(self.sim.start())

    @property
    def url(self) -> str:
        return self.sim.url

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(10)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args)` on the simulator's loop (a control method, or a read of its state)."""

        async def run() -> T:
            return fn(*args, **kwargs)

        result: T = self._run(run())
        return result

    def lists(self) -> int:
        return self.call(lambda: self.sim.lists_served["pods"])

    def stop(self) -> None:
        try:
            self._run(self.sim.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()


def _pod_is(pod: dict[str, Any], ip: str, labels: dict[str, str]) -> bool:
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"])
    meta = pod["metadata"]
    return ready and not meta.get("deletionTimestamp") and meta["labels"] == labels and pod["status"]["podIP"] == ip


def _converge(sim: K8sApiSim, wanted: dict[str, tuple[str, dict[str, str]]]) -> None:
    """(On the simulator's loop.) Exactly these pods, Ready: name -> (ip, labels); a pod that
    already is as wanted is left alone (no event, no leave and rejoin)."""
    pods = sim.pods()
    for name, pod in pods.items():
        if name not in wanted or not _pod_is(pod, *wanted[name]):
            sim.delete_pod(name)
    for name, (ip, labels) in wanted.items():
        if name not in pods or not _pod_is(pods[name], ip, labels):
            sim.add_pod(name, ip, labels)


class Cluster:
    """The union gateway over an InferencePool, and the pods it may select."""

    def __init__(self, gateway: SimGateway, api: ApiServer, sims: dict[str, EngineSim], port: int, port2: int) -> None:
        self.gateway, self.api, self.sims, self.port, self.port2 = gateway, api, sims, port, port2

    def pool(self) -> dict[str, Any]:
        pool: dict[str, Any] = self.gateway.state()["pools"]["union"]
        return pool

    def wait_routes(self, *addresses: str, timeout: float = 10) -> float:
        """Seconds until the processor routes to exactly these engines (host:port)."""
        start, wanted = time.monotonic(), dict.fromkeys(addresses, "routes")
        while (instances := self.pool()["instances"]) != wanted:
            if time.monotonic() - start > timeout:
                raise AssertionError(f"routes to {instances}, not {sorted(wanted)}")
            time.sleep(0.02)
        return time.monotonic() - start

    def baseline(self) -> None:
        _baseline(self.api, self.port)


def _baseline(api: ApiServer, port: int) -> None:
    """The InferencePool selects A on the first port; pod a1 (A) and b1, b2 (B) are Ready."""
    api.call(api.sim.put_inference_pool, POOL, A, [port])
    pods = {"a1": ("127.0.0.41", A), "b1": ("127.0.0.44", B), "b2": ("127.0.0.45", B)}
    api.call(_converge, api.sim, pods)


def _chat(base_url: str, **extra: Any) -> httpx.Response:
    return httpx.post(base_url + "/v1/chat/completions", json={**CHAT, **extra}, timeout=30)


def _generates(*sims: EngineSim) -> int:
    return sum(len(sim.generate_requests()) for sim in sims)


@pytest.fixture(scope="module")
def cluster_gateway(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("elastic-k8s")
    port, port2 = free_port(), free_port()
    hosts = {"a1": 41, "a2": 42, "a3": 43, "b1": 44, "b2": 45, "stray": 49}
    servers = {name: SimServer(EngineSim(host=f"127.0.0.{k}", port=port)).start() for name, k in hosts.items()}
    # b1 and b2 serve a second port too (an InferencePool with two target ports: two ranks)
    servers |= {
        f"{name}:2": SimServer(EngineSim(host=f"127.0.0.{hosts[name]}", port=port2)).start() for name in ("b1", "b2")
    }
    sims = {name: server.sim for name, server in servers.items()}
    api = ApiServer(NAMESPACE)
    _baseline(api, port)
    discovery = {"source": "kubernetes", "namespace": NAMESPACE, "inference_pool": POOL, "api_url": api.url, **FLAP}
    try:
        config, gateway = start_discovered_gateway(
            stack, work, [{"name": "union", "role": "union", "discovery": discovery}]
        )
    except BaseException:
        api.stop()
        for server in servers.values():
            server.close()
        raise
    try:
        yield Cluster(SimGateway(config, gateway, list(sims.values())), api, sims, port, port2)
    finally:
        gateway.stop()
        api.stop()
        for server in servers.values():
            server.close()


@pytest.fixture
def cluster(cluster_gateway: Cluster) -> Iterator[Cluster]:
    """The baseline before each test (a1 the only member); nothing leaked after it."""
    cluster_gateway.baseline()
    cluster_gateway.wait_routes(cluster_gateway.sims["a1"].address, timeout=15)
    cluster_gateway.gateway.restore()
    yield cluster_gateway
    cluster_gateway.gateway.assert_no_leaks()
    cluster_gateway.gateway.restore()


def test_a_ready_pod_joins_within_2s_and_other_pods_never_do(cluster: Cluster) -> None:
    a1, a2, a3, stray = (cluster.sims[n] for n in ("a1", "a2", "a3", "stray"))
    sim = cluster.api.sim
    cluster.api.call(sim.add_pod, "stray", stray.host, OTHER)  # Ready, not the pool's labels
    cluster.api.call(sim.add_pod, "a3", a3.host, A, ready=False)  # the pool's, not Ready yet
    cluster.api.call(sim.add_pod, "a2", a2.host, A)
    took = cluster.wait_routes(a1.address, a2.address)
    assert took < 2.0, f"the new pod routed {took:.2f} s after it was Ready"
    for _ in range(6):
        assert _chat(cluster.gateway.base_url).status_code == 200
    assert len(a1.generate_requests()) == len(a2.generate_requests()) == 3  # round robin over both
    cluster.api.call(sim.set_ready, "a3", True)  # Ready now: a member
    cluster.wait_routes(a1.address, a2.address, a3.address, timeout=5)
    for _ in range(3):
        assert _chat(cluster.gateway.base_url).status_code == 200
    assert len(a3.generate_requests()) == 1
    others = [stray, *(cluster.sims[n] for n in cluster.sims if n.startswith("b"))]
    assert all(s.received == [] and s.probes == [] for s in others), "a pod of other labels was reached"
    assert cluster.pool()["source"] == "kubernetes"


def test_a_pod_not_ready_leaves_and_routes_again_after_damping(cluster: Cluster) -> None:
    a1, a2 = cluster.sims["a1"], cluster.sims["a2"]
    sim = cluster.api.sim
    cluster.api.call(sim.add_pod, "a2", a2.host, A)
    cluster.wait_routes(a1.address, a2.address)
    cluster.api.call(sim.set_ready, "a2", False)
    cluster.wait_routes(a1.address)  # no longer listed: neither routed nor held
    state = cluster.gateway.state()
    assert a2.address not in state["scheduler"]["instances"]
    before = len(a2.generate_requests())
    for _ in range(4):
        assert _chat(cluster.gateway.base_url).status_code == 200
    assert len(a2.generate_requests()) == before
    cluster.api.call(sim.set_ready, "a2", True)  # back within the flap window: held first
    deadline = time.monotonic() + 5
    while not cluster.pool()["instances"].get(a2.address, "").startswith("damped"):
        assert time.monotonic() < deadline, cluster.pool()
        time.sleep(0.02)
    assert _chat(cluster.gateway.base_url).status_code == 200 and len(a2.generate_requests()) == before
    cluster.wait_routes(a1.address, a2.address, timeout=5)  # after the hold (at most 1 s here)
    for _ in range(4):
        assert _chat(cluster.gateway.base_url).status_code == 200
    assert len(a2.generate_requests()) == before + 2


def test_a_deleted_pod_finishes_its_stream_and_takes_no_new_request(cluster: Cluster) -> None:
    a1, a2 = cluster.sims["a1"], cluster.sims["a2"]
    sim = cluster.api.sim
    cluster.api.call(sim.add_pod, "a2", a2.host, A)
    cluster.wait_routes(a1.address, a2.address)
    leaves = cluster.pool()["leaves"]
    for engine in (a1, a2):
        engine.token_delay_s = 0.05
    done: dict[str, httpx.Response] = {}
    body = {**CHAT, "max_tokens": 40, "stream": True}
    url = cluster.gateway.base_url + "/v1/chat/completions"
    stream = threading.Thread(target=lambda: done.setdefault("r", httpx.post(url, json=body, timeout=30)))
    stream.start()
    deadline = time.monotonic() + 5
    while not (a1.generate_requests() or a2.generate_requests()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (leaving, name), (staying, _) = sorted([(a1, "a1"), (a2, "a2")], key=lambda p: not p[0].generate_requests())
    cluster.api.call(sim.delete_pod, name, graceful=True)  # deletionTimestamp: still there, maybe Ready
    cluster.wait_routes(staying.address)
    assert name in cluster.api.call(sim.pods)  # it left while its pod was still terminating
    assert _chat(cluster.gateway.base_url).status_code == 200
    cluster.api.call(sim.delete_pod, name)  # the kubelet is done: the pod is gone
    stream.join(30)
    text = done["r"].text
    assert done["r"].status_code == 200 and text.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in text
    assert len(leaving.generate_requests()) == 1 and len(staying.generate_requests()) == 1
    state = cluster.gateway.assert_no_leaks()
    assert leaving.address not in state["scheduler"]["instances"]
    assert cluster.pool()["leaves"] == leaves + 1
    cluster.wait_routes(staying.address, timeout=1)  # the removal changed nothing more


def test_a_dropped_watch_resumes_and_a_compacted_one_relists(cluster: Cluster) -> None:
    a1, a2, a3 = (cluster.sims[n] for n in ("a1", "a2", "a3"))
    sim = cluster.api.sim
    cluster.api.call(sim.add_pod, "a2", a2.host, A)
    cluster.wait_routes(a1.address, a2.address)

    def dropped_then(*changes: Callable[[], None], compact: bool) -> None:
        """(On the simulator's loop.) Every watch breaks; the changes happen while nobody
        watches; with `compact`, etcd forgets them (a watch from before: 410 Gone)."""
        sim.drop_watches()
        for change in changes:
            change()
        if compact:
            sim.compact()

    # a dropped connection: the watch resumes from its resourceVersion and sees what it missed
    lists = cluster.api.lists()
    delete_a2, add_a3 = (lambda: sim.delete_pod("a2")), (lambda: sim.add_pod("a3", a3.host, A))
    cluster.api.call(dropped_then, delete_a2, add_a3, compact=False)
    cluster.wait_routes(a1.address, a3.address)
    assert cluster.api.lists() == lists  # resumed: no relist
    # compacted meanwhile: the resumed watch gets 410 Gone, and a relist shows a3 gone, a2 back
    delete_a3, add_a2 = (lambda: sim.delete_pod("a3")), (lambda: sim.add_pod("a2", a2.host, A))
    cluster.api.call(dropped_then, delete_a3, add_a2, compact=True)
    cluster.wait_routes(a1.address, a2.address)  # (a2 is back within the flap window: ~1 s damped)
    assert cluster.api.lists() > lists  # the pods were listed again
    for _ in range(4):
        assert _chat(cluster.gateway.base_url).status_code == 200
    assert len(a1.generate_requests()) == len(a2.generate_requests()) == 2


def test_the_pools_selector_and_target_ports_decide_the_members(cluster: Cluster) -> None:
    a1 = cluster.sims["a1"]
    b = [cluster.sims[n] for n in ("b1", "b2", "b1:2", "b2:2")]
    assert {s.host for s in b} == {"127.0.0.44", "127.0.0.45"}  # two pods, two ports each
    cluster.api.call(cluster.api.sim.put_inference_pool, POOL, B, [cluster.port, cluster.port2])
    cluster.wait_routes(*(s.address for s in b))
    before = len(a1.generate_requests())
    for _ in range(8):
        assert _chat(cluster.gateway.base_url).status_code == 200
    assert [len(s.generate_requests()) for s in b] == [2, 2, 2, 2]  # round robin over four instances
    assert len(a1.generate_requests()) == before
    # one target port again: each pod is one instance
    cluster.api.call(cluster.api.sim.put_inference_pool, POOL, B, [cluster.port2])
    cluster.wait_routes(*(s.address for s in b[2:]))


# -- P/D: a prefill and a decode pool from one selector, by llm-d's role label


class PdCluster:
    def __init__(self, gateway: SimGateway, api: ApiServer, sims: dict[str, EngineSim]) -> None:
        self.gateway, self.api, self.sims = gateway, api, sims

    def wait_pools(self, pools: dict[str, list[str]], timeout: float = 10) -> None:
        """Until each pool routes to exactly these pods (their simulators' addresses)."""
        wanted = {role: {self.sims[name].address: "routes" for name in names} for role, names in pools.items()}
        deadline = time.monotonic() + timeout
        while True:
            state = self.gateway.state()["pools"]
            have = {role: state[role]["instances"] for role in pools}
            if have == wanted:
                return
            assert time.monotonic() < deadline, f"pools {have}, not {wanted}"
            time.sleep(0.02)

    def roles(self) -> dict[str, str]:
        """The scheduler's view: each instance's role (what planning picks legs from)."""
        instances = self.gateway.state()["scheduler"]["instances"]
        return {address: entry["role"] for address, entry in instances.items()}


@pytest.fixture(scope="module")
def pd(stack: RunningStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdCluster]:
    work = tmp_path_factory.mktemp("elastic-k8s-pd")
    port = free_port()
    hosts = {"p1": 46, "d1": 47, "d2": 48}
    servers = {name: SimServer(EngineSim(host=f"127.0.0.{k}", port=port)).start() for name, k in hosts.items()}
    sims = {name: server.sim for name, server in servers.items()}
    api = ApiServer(NAMESPACE)
    api.call(api.sim.add_pod, "p1", sims["p1"].host, {**PD, ROLE: "prefill"})
    api.call(api.sim.add_pod, "d1", sims["d1"].host, {**PD, ROLE: "decode"})
    discovery = {"source": "kubernetes", "namespace": NAMESPACE, "selector": PD, "port": port, "api_url": api.url}
    discovery |= FLAP
    pools = [{"name": role, "role": role, "discovery": discovery} for role in ("prefill", "decode")]
    try:
        config, gateway = start_discovered_gateway(stack, work, pools)
    except BaseException:
        api.stop()
        for server in servers.values():
            server.close()
        raise
    bench = PdCluster(SimGateway(config, gateway, list(sims.values())), api, sims)
    try:
        yield bench
        bench.gateway.assert_no_leaks()
    finally:
        gateway.stop()
        api.stop()
        for server in servers.values():
            server.close()


def _generate_bodies(sim: EngineSim) -> list[dict[str, Any]]:
    return [r.json() for r in sim.generate_requests()]


def test_role_labels_make_prefill_and_decode_pools(pd: PdCluster) -> None:
    p1, d1 = pd.sims["p1"], pd.sims["d1"]
    pd.wait_pools({"prefill": ["p1"], "decode": ["d1"]})  # each pod in its role's pool only
    assert pd.roles() == {p1.address: "prefill", d1.address: "decode"}
    response = _chat(pd.gateway.base_url, max_tokens=5)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 5
    [prefill] = _generate_bodies(p1)
    [decode] = _generate_bodies(d1)
    assert prefill["stream"] is False and prefill["sampling_params"]["max_tokens"] == 1
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert decode["token_ids"] == prefill["token_ids"] and decode["sampling_params"]["max_tokens"] == 5
    assert decode["kv_transfer_params"]["do_remote_prefill"] is True
    assert decode["kv_transfer_params"]["remote_request_id"] == "generate-tokens-" + prefill["request_id"]


# Both pools watch the same pods: a relabel is one event on each pool's watch, and the
# processor hears them in either order (the order the two watches were opened in). Moving the
# pod both ways makes the pool it joins publish before the pool it leaves in one of the moves,
# which `Membership.publish` (ext_proc/fleet/membership.py) gets wrong: it skips an address
# another pool still holds, and nothing offers it again once that pool lets it go (the source
# publishes only changes), so the pod serves in neither pool until the next relist.
def test_a_relabelled_pod_moves_between_pools(pd: PdCluster) -> None:
    d2 = pd.sims["d2"]
    sim = pd.api.sim
    pd.api.call(sim.add_pod, "d2", d2.host, {**PD, ROLE: "decode"})
    pd.wait_pools({"prefill": ["p1"], "decode": ["d1", "d2"]})
    for role, pools in (
        ("prefill", {"prefill": ["p1", "d2"], "decode": ["d1"]}),
        ("decode", {"prefill": ["p1"], "decode": ["d1", "d2"]}),
    ):
        pd.api.call(sim.set_labels, "d2", {**PD, ROLE: role})
        pd.wait_pools(pools, timeout=5)  # (a move back is damped: at most 1 s here)
        expected = {pd.sims[name].address: pool for pool, names in pools.items() for name in names}
        assert pd.roles() == expected, f"d2 relabelled {role}: the scheduler's roles differ from the pools"
        pd.gateway.restore()
        for _ in range(4):
            assert _chat(pd.gateway.base_url).status_code == 200
        for pool, names in pools.items():  # round robin within each pool, each leg on its role's pods
            param = "do_remote_decode" if pool == "prefill" else "do_remote_prefill"
            for name in names:
                legs = _generate_bodies(pd.sims[name])
                assert len(legs) == 4 // len(names), (name, pool, len(legs))
                assert all(leg["kv_transfer_params"][param] for leg in legs)
