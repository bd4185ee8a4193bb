"""tito as an InferencePool's endpoint picker behind a GIE-style Envoy (`tests/gie_gateway.py`,
none of tito's own bootstrap), over engine simulators and the stack's real render sidecar:
the EPP protocol v1 as a gateway exercises it. Each check names what would make it fail."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ext_proc.tools import epp_check
from tests.conftest import RunningStack, SimGateway, free_port, start_gateway, start_sim_gateway
from tests.engine_sim import EngineSim, Fault, SimServer
from tests.gie_gateway import SUBSET_HEADER, GieEnvoy, start_gie_envoy

BUDGET = 300  # tokens: a few small chats at once, never one of 500
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Pick me 你好"}], "max_tokens": 3}


def _gateway(
    stack: RunningStack,
    envoy_bin: Path,
    work: Path,
    kind: str,
    named: int,
    grpc_server: str = "h2",
    **sections: object,
) -> Iterator[tuple[SimGateway, GieEnvoy, list]]:
    processor = {"destination_endpoints": named, "grpc_server": grpc_server}
    gateway, servers = start_sim_gateway(
        stack, work, 2, scheduler={"policy": "round_robin"}, processor=processor, **sections
    )
    members = [(s.sim.host, s.sim.port) for s in servers]
    envoy = None
    try:
        port, admin = free_port(), free_port()
        envoy = start_gie_envoy(envoy_bin, work, port, admin, gateway.config.processor.port, kind, members)
        yield gateway, envoy, servers
    finally:
        if envoy is not None:
            envoy.stop()
        gateway.gateway.stop()
        for server in servers:
            server.close()


@pytest.fixture(scope="module")
def original_dst(
    stack: RunningStack, envoy_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SimGateway, GieEnvoy, list]]:
    """GIE's reference shape: ORIGINAL_DST on the header, so the picker names one endpoint;
    a token budget small enough to shed a large request."""
    work = tmp_path_factory.mktemp("gie-odst")
    yield from _gateway(stack, envoy_bin, work, "original_dst", 1, admission={"global_token_budget": BUDGET})


@pytest.fixture(scope="module")
def override_host(
    stack: RunningStack, envoy_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SimGateway, GieEnvoy, list]]:
    """A gateway that takes the ordered list (override_host) and walks it on a retry; relay on.
    Its processor serves on grpc.aio (`processor.grpc_server: grpcio`), so the tests on this
    fixture, `epp_check` among them (health services too), also check that server."""
    work = tmp_path_factory.mktemp("gie-oh")
    yield from _gateway(stack, envoy_bin, work, "override_host", 0, "grpcio", reschedule={"enable": True})


def _chat(envoy: GieEnvoy, subset: str | None = None, **fields: object) -> httpx.Response:
    headers = {SUBSET_HEADER: subset} if subset is not None else {}
    return httpx.post(
        envoy.base_url + "/v1/chat/completions", json={**CHAT, **fields}, headers=headers, timeout=30, trust_env=False
    )


def _served(sims: list[EngineSim]) -> list[int]:
    return [len(sim.received) for sim in sims]


def test_the_pick_stays_inside_the_subset(original_dst: tuple[SimGateway, GieEnvoy, list]) -> None:
    gateway, envoy, _ = original_dst
    gateway.restore()
    for _ in range(4):  # round robin without a subset: both engines (so a picker ignoring it fails below)
        assert _chat(envoy).status_code == 200
    assert _served(gateway.sims) == [2, 2]
    for n, sim in enumerate(gateway.sims):
        gateway.restore()
        for _ in range(4):
            response = _chat(envoy, subset=sim.address)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] == "length"
        assert _served(gateway.sims) == ([4, 0] if n == 0 else [0, 4])
    gateway.restore()
    both = ",".join(sim.address for sim in gateway.sims)  # the comma-string form of the list
    for _ in range(4):
        assert _chat(envoy, subset=both).status_code == 200
    assert _served(gateway.sims) == [2, 2]
    gateway.assert_no_leaks()


def test_a_subset_with_no_member_is_503(original_dst: tuple[SimGateway, GieEnvoy, list]) -> None:
    gateway, envoy, _ = original_dst
    gateway.restore()
    for subset in ("192.0.2.1:9", ","):  # outside the pool; an empty list
        response = _chat(envoy, subset=subset)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] and "subset" in error["message"]
    assert _served(gateway.sims) == [0, 0]
    # Streaming and an engine's own route alike.
    assert _chat(envoy, subset="192.0.2.1:9", stream=True).status_code == 503
    gateway.assert_no_leaks()


def test_the_header_names_one_endpoint_for_original_dst(original_dst: tuple[SimGateway, GieEnvoy, list]) -> None:
    gateway, envoy, _ = original_dst
    gateway.restore()
    assert _chat(envoy).status_code == 200
    (received,) = [r for sim in gateway.sims for r in sim.received]
    assert received.path == "/inference/v1/generate"  # token-only behind a GIE gateway too
    assert received.headers["x-gateway-destination-endpoint"] in {sim.address for sim in gateway.sims}
    assert envoy.stat("cluster.pool.original_dst_host_invalid") == 0


def test_shed_is_429_in_the_api_envelope(original_dst: tuple[SimGateway, GieEnvoy, list]) -> None:
    gateway, envoy, _ = original_dst
    gateway.restore()
    response = _chat(envoy, max_tokens=2 * BUDGET)  # within the context, past the budget
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] in (429, "429", "token_budget_exceeded")
    assert _served(gateway.sims) == [0, 0]
    gateway.assert_no_leaks()


def test_the_served_report_is_what_breakers_learn(override_host: tuple[SimGateway, GieEnvoy, list]) -> None:
    """The first engine of the list fails the request (503, before any output): the gateway
    walks the list to the second and reports it as served. Without reading the report the
    processor learns nothing (no `x-tito-upstream-host`, no attempt count behind a GIE
    gateway): neither the failure nor who answered."""
    gateway, envoy, _ = override_host
    gateway.restore()
    fault = Fault("status", status=503, times=1)  # the first engine asked, whichever it is
    for sim in gateway.sims:
        sim.fault = fault
    retries = envoy.stat("cluster.pool.upstream_rq_retry")
    response = _chat(envoy)
    assert response.status_code == 200, response.text
    assert envoy.stat("cluster.pool.upstream_rq_retry") == retries + 1  # the ordered list, walked
    instances = gateway.state()["scheduler"]["instances"]
    failures = sorted(instances[sim.address]["consecutive_failures"] for sim in gateway.sims)
    assert failures == [0, 1]  # the first engine failed, the one that served did not
    assert sorted(len(sim.received) for sim in gateway.sims) == [1, 1]
    gateway.assert_no_leaks()
    gateway.restore()
    assert _chat(envoy).status_code == 200  # (a success closes the failed breaker's count again)


def test_health_services_on_the_ext_proc_port(original_dst: tuple[SimGateway, GieEnvoy, list]) -> None:
    gateway, _, _ = original_dst

    async def check(service: str) -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.config.processor.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            return int(response.status)

    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""):
        assert asyncio.run(check(service)) == serving
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        asyncio.run(check("no.such.Service"))
    assert unknown.value.code() is grpc.StatusCode.NOT_FOUND


def test_a_gateway_that_keeps_the_response_body_gets_native_routing(
    original_dst: tuple[SimGateway, GieEnvoy, list], envoy_bin: Path, tmp_path: Path
) -> None:
    """response_body_mode NONE: nothing could derender a token-only answer, so the request
    goes to the engine's own route as the client sent it, and its answer reaches the client."""
    gateway, _, servers = original_dst
    gateway.restore()
    members = [(s.sim.host, s.sim.port) for s in servers]
    port, admin, processor = free_port(), free_port(), gateway.config.processor.port
    envoy = start_gie_envoy(envoy_bin, tmp_path, port, admin, processor, "original_dst", members, response_body="NONE")
    try:
        for stream in (False, True):
            response = _chat(envoy, stream=stream)
            assert response.status_code == 200, response.text
            if stream:
                assert response.text.rstrip().endswith("data: [DONE]")
            else:
                assert response.json()["object"] == "chat.completion"
        received = [r for sim in gateway.sims for r in sim.received]
        assert [r.path for r in received] == ["/v1/chat/completions"] * 2
        bodies = sorted((orjson.loads(r.body) for r in received), key=lambda b: bool(b["stream"]))
        assert bodies == [{**CHAT, "stream": False}, {**CHAT, "stream": True}]  # as the client sent them
    finally:
        envoy.stop()
    gateway.assert_no_leaks()


def test_epp_check_passes_against_tito(override_host: tuple[SimGateway, GieEnvoy, list]) -> None:
    """`tito epp-check`, the published protocol check, run on the processor as any EPP."""
    gateway, _, _ = override_host
    gateway.restore()
    epp = f"127.0.0.1:{gateway.config.processor.port}"
    assert epp_check.main(["--epp", epp, "--model", "tiny", "--timeout", "30"]) == 0
    gateway.assert_no_leaks()


def _events(body: bytes) -> list[object]:
    return [
        line[6:].decode() if line == b"data: [DONE]" else orjson.loads(line[6:])
        for line in body.split(b"\n")
        if line.startswith(b"data: ")
    ]


def test_a_stream_whose_engine_dies_is_relayed_inside_the_subset(
    override_host: tuple[SimGateway, GieEnvoy, list],
) -> None:
    """Relay behind a GIE gateway: the processor runs the engine streams itself, and the
    stream's second engine is still one of the gateway's subset."""
    gateway, envoy, _ = override_host
    gateway.restore()
    fault = Fault("abort", after_tokens=4, times=1)  # the first engine stream, wherever it goes
    for sim in gateway.sims:
        sim.fault = fault
    subset = ",".join(sim.address for sim in gateway.sims)
    body = {"model": "tiny", "prompt": "relay me", "max_tokens": 12, "stream": True}
    response = httpx.post(
        envoy.base_url + "/v1/completions", json=body, headers={SUBSET_HEADER: subset}, timeout=30, trust_env=False
    )
    events = _events(response.content)
    assert response.status_code == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    hosts = [sim.address for sim in gateway.sims for _ in sim.generate_requests()]
    assert sorted(hosts) == sorted(sim.address for sim in gateway.sims)  # one stream on each: relayed
    gateway.assert_no_leaks()


@pytest.fixture
def pd_pair(
    stack: RunningStack, envoy_bin: Path, tmp_path: Path
) -> Iterator[tuple[SimGateway, GieEnvoy, dict[str, list[SimServer]]]]:
    """Two prefill and two decode simulators (Handoff), every one a member of the GIE pool."""
    servers = {role: [SimServer(EngineSim()).start() for _ in range(2)] for role in ("prefill", "decode")}
    pools = [
        {"name": role, "role": role, "instances": [{"port": s.sim.port} for s in group]}
        for role, group in servers.items()
    ]
    config, stack_gateway = start_gateway(stack, tmp_path, [], pools=pools, scheduler={"policy": "round_robin"})
    gateway = SimGateway(config, stack_gateway, [s.sim for group in servers.values() for s in group])
    members = [(s.sim.host, s.sim.port) for group in servers.values() for s in group]
    envoy = None
    try:
        port, admin = free_port(), free_port()
        envoy = start_gie_envoy(envoy_bin, tmp_path, port, admin, config.processor.port, "override_host", members)
        yield gateway, envoy, servers
    finally:
        if envoy is not None:
            envoy.stop()
        stack_gateway.stop()
        for group in servers.values():
            for server in group:
                server.close()


def test_a_handoff_pair_is_picked_inside_the_subset(
    pd_pair: tuple[SimGateway, GieEnvoy, dict[str, list[SimServer]]],
) -> None:
    gateway, envoy, servers = pd_pair
    prefill, decode = servers["prefill"][1].sim, servers["decode"][1].sim
    for stream in (False, True, False, True):
        response = _chat(envoy, subset=f"{prefill.address},{decode.address}", stream=stream)
        assert response.status_code == 200, response.text
    calls = {sim.address: len(sim.generate_requests()) for sim in gateway.sims}
    assert calls == {s.sim.address: 4 if s.sim in (prefill, decode) else 0 for g in servers.values() for s in g}
    first_leg = [r.json() for r in prefill.generate_requests()]
    assert all(leg["kv_transfer_params"]["do_remote_decode"] for leg in first_leg)
    gateway.assert_no_leaks()
