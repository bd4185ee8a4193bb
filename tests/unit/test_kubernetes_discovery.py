"""The Kubernetes membership source against the API-server simulator (tests/k8s_api_sim.py):
who is a member (Ready, not deleting, the selector's, the pool role's, per target port), the
InferencePool driving the selector, and list + watch surviving what a real API server does
(bookmarks, 410 after compaction, dropped watches, being down)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from ext_proc.config_discovery import DiscoveryConfig
from ext_proc.fleet.discovery import Found
from ext_proc.fleet.discovery.kubernetes import KubernetesSource
from tests.k8s_api_sim import TRUE, K8sApiSim

pytestmark = pytest.mark.timeout(30)

APP = {"app": "vllm"}
ROLE = "llm-d.ai/role"


class Publications:
    """What the source published, in order."""

    def __init__(self) -> None:
        self.all: list[frozenset[Found]] = []

    def __call__(self, members: frozenset[Found]) -> None:
        self.all.append(members)

    @property
    def last(self) -> frozenset[Found] | None:
        return self.all[-1] if self.all else None


async def wait_until(check: Callable[[], bool], what: Callable[[], object], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out; {what()}"
        await asyncio.sleep(0.01)


async def published(publications: Publications, expected: frozenset[Found]) -> None:
    """Wait until the last publication is `expected`."""
    await wait_until(lambda: publications.last == expected, lambda: f"last published {publications.last}")


def at(*hosts: str, ports: tuple[int, ...] = (8000,)) -> frozenset[Found]:
    return frozenset(Found(host, port) for host in hosts for port in ports)


@asynccontextmanager
async def api_server() -> AsyncIterator[K8sApiSim]:
    sim = await K8sApiSim().start()
    try:
        yield sim
    finally:
        await sim.stop()


@asynccontextmanager
async def discovering(sim: K8sApiSim, role: str = "union", **settings: Any) -> AsyncIterator[Publications]:
    source = KubernetesSource(DiscoveryConfig(source="kubernetes", api_url=sim.url, **settings), role)
    publications = Publications()
    task = asyncio.create_task(source.run(publications))
    try:
        yield publications
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_first_publication_comes_even_when_nothing_is_found() -> None:
    async with api_server() as sim, discovering(sim, selector=APP) as publications:
        await wait_until(lambda: publications.all == [frozenset()], lambda: publications.all)


async def test_ready_pods_of_the_selector_join_and_leave_as_they_change() -> None:
    async with api_server() as sim:
        sim.add_pod("a", "10.0.0.1", APP)
        sim.add_pod("b", "10.0.0.2", APP, ready=False)
        sim.add_pod("other", "10.0.0.9", {"app": "other"})
        async with discovering(sim, selector=APP) as publications:
            await published(publications, at("10.0.0.1"))
            sim.set_ready("b", True)
            await published(publications, at("10.0.0.1", "10.0.0.2"))
            sim.set_ready("a", False)
            await published(publications, at("10.0.0.2"))
            sim.delete_pod("b", graceful=True)  # still Ready, but terminating
            await published(publications, at())
            sim.add_pod("c", "10.0.0.3", APP)
            await published(publications, at("10.0.0.3"))
            sim.delete_pod("c")
            await published(publications, at())
            sim.set_labels("other", APP)  # relabelled into the selector: the watch says ADDED
            await published(publications, at("10.0.0.9"))
            sim.set_labels("other", {"app": "other"})  # and out of it: DELETED
            await published(publications, at())
        assert sim.lists_served["pods"] == 1


async def test_an_ipv6_pod_ip_is_bracketed() -> None:
    async with api_server() as sim, discovering(sim, selector=APP, port=8100) as publications:
        sim.add_pod("a", "fd00::1", APP)
        await published(publications, frozenset({Found("[fd00::1]", 8100)}))


@pytest.mark.parametrize(
    ("role", "members"),
    [
        ("union", {"unlabelled", "prefill-decode", "both"}),
        ("prefill", {"prefill", "encode-prefill"}),
        ("decode", {"decode", "encode-decode"}),
    ],
)
async def test_a_pd_pool_takes_the_pods_whose_role_label_says_its_role(role: str, members: set[str]) -> None:
    values = ["prefill-decode", "both", "prefill", "encode-prefill", "decode", "encode-decode", "encode"]
    async with api_server() as sim:
        sim.add_pod("unlabelled", "10.0.1.0", APP)
        for i, value in enumerate(values, start=1):
            sim.add_pod(value, f"10.0.1.{i}", {**APP, ROLE: value})
        ips = {"unlabelled": "10.0.1.0"} | {value: f"10.0.1.{i}" for i, value in enumerate(values, start=1)}
        async with discovering(sim, role=role, selector=APP) as publications:
            await published(publications, at(*(ips[name] for name in members)))


async def test_an_inference_pools_selector_and_every_target_port_make_the_members() -> None:
    async with api_server() as sim:
        sim.add_pod("a", "10.0.0.1", APP)
        sim.add_pod("b", "10.0.0.2", {"app": "next"})
        sim.put_inference_pool("pool", APP, [8000, 8001])
        async with discovering(sim, inference_pool="pool") as publications:
            await published(publications, at("10.0.0.1", ports=(8000, 8001)))
            # The watches open after the lists are published: wait for them, not race them.
            await wait_until(lambda: "inferencepools" in sim.last_watch, lambda: sim.last_watch)
            assert sim.last_watch["inferencepools"]["fieldSelector"] == "metadata.name=pool"
            sim.put_inference_pool("pool", {"app": "next"}, [8002])  # a new selector moves the membership
            await published(publications, at("10.0.0.2", ports=(8002,)))
            assert sim.lists_served["pods"] == 2
            # The new watch opens after the relist is published: wait for it, not race it.
            await wait_until(lambda: sim.last_watch["pods"]["labelSelector"] == "app=next", lambda: sim.last_watch)
            sim.add_pod("c", "10.0.0.3", APP)  # the old selector's pods no longer count
            sim.add_pod("d", "10.0.0.4", {"app": "next"})
            await published(publications, at("10.0.0.2", "10.0.0.4", ports=(8002,)))


async def test_llm_ds_active_ports_annotation_keeps_only_the_target_ports_it_names() -> None:
    async with api_server() as sim:
        sim.put_inference_pool("pool", APP, [8000, 8001, 8002])
        sim.add_pod("all", "10.0.0.1", APP)
        sim.add_pod("some", "10.0.0.2", APP, annotations={"llm-d.ai/active-ports": "8001, 8002,9000,x"})
        sim.add_pod("legacy", "10.0.0.3", APP, annotations={"inference.networking.k8s.io/active-ports": "8000"})
        sim.add_pod("none", "10.0.0.4", APP, annotations={"llm-d.ai/active-ports": ""})
        async with discovering(sim, inference_pool="pool") as publications:
            expected = (
                at("10.0.0.1", ports=(8000, 8001, 8002))
                | at("10.0.0.2", ports=(8001, 8002))
                | at("10.0.0.3", ports=(8000,))
            )
            await published(publications, expected)


async def test_a_missing_inference_pool_has_no_members_until_it_exists(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tito.discovery")
    async with api_server() as sim:
        sim.add_pod("a", "10.0.0.1", APP)
        async with discovering(sim, inference_pool="pool") as publications:
            await wait_until(lambda: publications.all == [frozenset()], lambda: publications.all)
            assert "InferencePool default/pool does not exist" in caplog.text
            sim.put_inference_pool("pool", APP, [8000])
            await published(publications, at("10.0.0.1"))
            sim.delete_inference_pool("pool")
            await published(publications, at())


async def test_bookmarks_are_asked_for_and_a_watch_resumes_from_the_last_one() -> None:
    async with api_server() as sim:
        sim.add_pod("a", "10.0.0.1", APP)
        async with discovering(sim, selector=APP) as publications:
            await published(publications, at("10.0.0.1"))
            await wait_until(lambda: "pods" in sim.last_watch, lambda: sim.last_watch)  # (opened after the list)
            assert sim.last_watch["pods"]["allowWatchBookmarks"] in TRUE
            sim.bump()  # other objects change: the revision moves past every pod's
            bookmark = sim.send_bookmarks()
            sim.end_watches()  # as at timeoutSeconds
            await wait_until(lambda: sim.watches_served["pods"] == 2, lambda: sim.watches_served)
            assert sim.last_watch["pods"]["resourceVersion"] == str(bookmark)
            assert sim.lists_served["pods"] == 1


async def test_a_410_relists_and_a_pod_deleted_in_the_gap_leaves() -> None:
    async with api_server() as sim:
        sim.add_pod("a", "10.0.0.1", APP)
        sim.add_pod("b", "10.0.0.2", APP)
        async with discovering(sim, selector=APP) as publications:
            await published(publications, at("10.0.0.1", "10.0.0.2"))
            sim.drop_watches()
            sim.delete_pod("b")  # while disconnected; its DELETED event is compacted away
            sim.compact()
            await published(publications, at("10.0.0.1"))
            assert sim.lists_served["pods"] == 2
            await wait_until(lambda: sim.watches_served["pods"] == 3, lambda: sim.watches_served)


async def test_a_dropped_watch_resumes_from_its_resource_version_without_a_relist() -> None:
    async with api_server() as sim:
        sim.add_pod("a", "10.0.0.1", APP)
        async with discovering(sim, selector=APP) as publications:
            await published(publications, at("10.0.0.1"))
            sim.drop_watches()
            sim.add_pod("b", "10.0.0.2", APP)
            await published(publications, at("10.0.0.1", "10.0.0.2"))
            assert (sim.lists_served["pods"], sim.watches_served["pods"]) == (1, 2)


async def test_the_api_server_down_keeps_the_membership_until_it_is_back(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tito.discovery")
    async with api_server() as sim:
        sim.add_pod("a", "10.0.0.1", APP)
        async with discovering(sim, selector=APP) as publications:
            await published(publications, at("10.0.0.1"))
            await sim.stop()
            await wait_until(lambda: "Cannot connect" in caplog.text, lambda: caplog.text)
            assert publications.last == at("10.0.0.1")
            sim.add_pod("b", "10.0.0.2", APP)  # etcd goes on while this API server is down
            await sim.start()  # the same port
            await published(publications, at("10.0.0.1", "10.0.0.2"))
            assert sim.lists_served["pods"] == 1


async def test_a_token_file_is_sent_as_a_bearer_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    async with api_server() as sim, discovering(sim, selector=APP, token_file=str(token)) as publications:
        await published(publications, at())
        assert sim.authorization == "Bearer s3cret"
        token.write_text("rotated")
        sim.add_pod("a", "10.0.0.1", APP)
        sim.end_watches()  # the next watch is a new request, with the token read again
        await wait_until(lambda: sim.authorization == "Bearer rotated", lambda: sim.authorization)
