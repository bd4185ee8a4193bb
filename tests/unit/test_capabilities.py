"""Capability records: what vLLM 0.32's answers parse into (golden bodies captured from a CPU
engine and render server), what a record decides (routes, token-only, adopt, hold out), and
how a dead engine leaves routing and comes back (liveness checks, failed requests)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx
import pytest

from ext_proc.config import TitoConfig
from ext_proc.fleet.capabilities import Capabilities
from ext_proc.fleet.capability_probe import (
    parse_cache_config,
    parse_kv_event_sources,
    parse_models,
    parse_tokenized,
)
from ext_proc.frontend.tokenization import LocalTokenizer, TokenizationService
from ext_proc.planning.planner import Planner
from ext_proc.server import build_scheduler
from scheduler import KvCacheAffinity, Pool, Role, Scheduler, ScheduleRequest
from scheduler.capabilities import (
    EngineCapabilities,
    Expected,
    TokenOnlyRoute,
    assess,
    canary_reference,
    token_only_route,
    unready_pools,
)

# `GET /v1/models` of `vllm serve` 0.32 (permission list cut), plus one LoRA adapter entry
MODELS = {
    "object": "list",
    "data": [
        {
            "id": "tiny",
            "object": "model",
            "owned_by": "vllm",
            "root": "/cache/tiny-qwen3-v2",
            "parent": None,
            "max_model_len": 2048,
        },
        {"id": "sql-lora", "object": "model", "owned_by": "vllm", "root": "/adapters/sql", "parent": "tiny"},
    ],
}
# `vllm:cache_config_info` of a CPU engine (labels cut to a few around the ones read)
CACHE_INFO = (
    'vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",'
    'enable_prefix_caching="True",engine="0",hash_block_size="None",kv_cache_size_tokens="1048576",'
    'num_gpu_blocks="8192",prefix_caching_hash_algo="sha256_cbor",sliding_window="None"} 1.0'
)
EXPECTED = Expected("tiny", 2048, 128, "sha256_cbor")
FINGERPRINT = "vllm-0.32.0-0123abcd"  # `system_fingerprint` of a 0.32 engine's native answers


def record(**fields: object) -> EngineCapabilities:
    base: dict[str, object] = {
        "version": "0.32.0",
        "served_models": ("tiny",),
        "max_model_len": 2048,
        "block_size": 128,
        "hash_algo": "sha256_cbor",
        "token_only": TokenOnlyRoute.LIVE,
        "canary": (1, 2, 3),
    }
    return EngineCapabilities("10.0.0.1:8000", **{**base, **fields})  # type: ignore[arg-type]


def test_vllm_answers_parse_into_a_record() -> None:
    assert parse_models(MODELS) == {
        "served_models": ("tiny",),
        "root": "/cache/tiny-qwen3-v2",
        "max_model_len": 2048,
        "lora_adapters": ("sql-lora",),
        "model_cards": tuple(MODELS["data"]),  # as listed: the gateway's /v1/models merges them
    }
    text = "# HELP vllm:cache_config_info Information\n# TYPE vllm:cache_config_info gauge\n" + CACHE_INFO + "\n"
    assert parse_cache_config(text) == {"block_size": 128, "hash_algo": "sha256_cbor"}
    assert parse_cache_config("vllm:num_requests_running 0.0\n") == {}  # a render server's /metrics
    sources = {"0": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}}
    assert parse_kv_event_sources(sources) == ("tcp://*:5557",)
    assert parse_kv_event_sources({}) == ()
    assert parse_tokenized({"count": 3, "max_model_len": 2048, "tokens": [1, 767, 205], "token_strs": None}) == (
        1,
        767,
        205,
    )
    assert parse_tokenized({"detail": "Not Found"}) is None
    with pytest.raises(ValueError):
        parse_models({"detail": "Not Found"})


@pytest.mark.parametrize(
    ("status", "route"),
    [
        (400, TokenOnlyRoute.LIVE),  # `{}` fails validation: the route is there
        (403, TokenOnlyRoute.DISABLED),  # vLLM 0.32 without --enable-scale-out
        (404, TokenOnlyRoute.ABSENT),
        (501, TokenOnlyRoute.ABSENT),
        (401, TokenOnlyRoute.AUTH),
        (500, TokenOnlyRoute.UNKNOWN),
    ],
)
def test_the_token_only_probe(status: int, route: TokenOnlyRoute) -> None:
    assert token_only_route(status) is route


def test_a_matching_engine_routes_token_only() -> None:
    verdict = assess(record(), EXPECTED, "adopt", (1, 2, 3))
    assert (verdict.routes, verdict.token_only, verdict.differences, verdict.held_out) == (True, True, (), None)


def test_an_engine_without_scale_out_routes_natively_unless_obfuscation_forbids_it() -> None:
    plain = record(token_only=TokenOnlyRoute.DISABLED)
    assert (assess(plain, EXPECTED, "adopt", None).routes, assess(plain, EXPECTED, "adopt", None).token_only) == (
        True,
        False,
    )
    closed = assess(plain, EXPECTED, "adopt", None, native_allowed=False)
    assert not closed.routes and "obfuscation" in str(closed.held_out)


@pytest.mark.parametrize(
    ("fields", "difference", "adopted"),
    [
        ({"block_size": 16}, "block_size 16 (config 128)", {"block_size": 16}),
        ({"max_model_len": 1024}, "max_model_len 1024 (config 2048)", {"max_model_len": 1024}),
        ({"hash_algo": "sha256"}, "hash_algo sha256 (config sha256_cbor)", {"hash_algo": "sha256"}),
    ],
)
def test_a_difference_from_config_is_adopted_or_held_out(
    fields: dict[str, object], difference: str, adopted: dict[str, object]
) -> None:
    verdict = assess(record(**fields), EXPECTED, "adopt", None)
    assert verdict.routes and verdict.differences == (difference,) and dict(verdict.adopted) == adopted
    held = assess(record(**fields), EXPECTED, "hold_out", None)
    assert not held.routes and held.held_out == f"differs from config: {difference}"


def test_a_tokenizer_mismatch_always_holds_out() -> None:
    for policy in ("adopt", "hold_out"):
        verdict = assess(record(canary=(1, 2, 4)), EXPECTED, policy, (1, 2, 3))
        assert not verdict.routes and "tokenizer mismatch" in str(verdict.held_out)
    assert assess(record(canary=None), EXPECTED, "hold_out", (1, 2, 3)).routes  # no /tokenize: unchecked


def test_no_record_or_another_model_does_not_route() -> None:
    assert assess(None, EXPECTED, "adopt", None).held_out == "no capability record: not probed yet"
    failed = EngineCapabilities("10.0.0.1:8000", error="ConnectError")
    assert assess(failed, EXPECTED, "adopt", None).held_out == "no capability record: ConnectError"
    assert not assess(record(served_models=("other",)), EXPECTED, "adopt", None).routes


def test_a_good_record_whose_engine_failed_since_does_not_route() -> None:
    verdict = assess(record(error="unreachable: ConnectError: refused"), EXPECTED, "adopt", (1, 2, 3))
    assert (verdict.routes, verdict.token_only, verdict.held_out) == (False, True, "unreachable: ConnectError: refused")


def test_the_canary_reference_is_what_most_endpoints_agree_on_ties_to_render() -> None:
    render = {"http://render:8100": (1, 2, 3)}
    assert canary_reference(render, [(9, 9), None]) == (1, 2, 3)  # one against one: render's
    assert canary_reference(render, [(9, 9), (9, 9)]) == (9, 9)  # the engines agree: render is the odd one
    assert canary_reference({"in_process": None}, [None]) is None


def test_ready_when_every_pool_has_an_engine_that_routes_else_each_pool_says_why() -> None:
    assert unready_pools({"prefill": {"a:1": "tokenizer mismatch", "b:2": None}, "decode": {"c:3": None}}) == {}
    pools = {"union": {"a:1": "unreachable: ConnectError", "b:2": "no capability record: not probed yet"}}
    assert unready_pools(pools) == {
        "union": "no engine routes (a:1 unreachable: ConnectError; b:2 no capability record: not probed yet)"
    }


def test_a_gated_scheduler_routes_only_what_its_records_let_route() -> None:
    pool = Pool.of("union", Role.UNION, ["a:1", "b:2"], block_size=4)
    scheduler = Scheduler([pool], KvCacheAffinity(), gated=True)
    request = ScheduleRequest("r", [1, 2, 3, 4, 5], max_tokens=8)
    rejected = scheduler.pick(request, 0.0)
    assert rejected.status == 503 and "a:1: no capability record yet" in rejected.reason  # type: ignore[union-attr]
    scheduler.set_capabilities("b:2", None, token_only=False)
    pick = scheduler.pick(request, 0.0)
    assert pick.instance.address == "b:2" and not scheduler.supports_token_only("b:2")  # type: ignore[union-attr]
    scheduler.set_capabilities("a:1", None, token_only=True, max_model_len=10)  # holds 10 tokens: 13 do not fit
    assert scheduler.pick(request, 0.0).instance.address == "b:2"  # type: ignore[union-attr]
    scheduler.set_capabilities("b:2", "tokenizer mismatch", token_only=False)
    too_long = scheduler.pick(request, 0.0)
    assert too_long.status == 400 and "needs 13 tokens" in too_long.reason  # type: ignore[union-attr]
    scheduler.adopt_block_size(Role.UNION, 2)
    assert scheduler.block_size(Role.UNION) == 2


class _Engines:
    """httpx transport answering probes as vLLM 0.32 engines do; `down` refuse connections."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.hung: set[str] = set()  # answer nothing in time
        self.health_status = 200
        self.block_size = 128
        self.health_checks = 0
        self.fingerprints: dict[str, str] = {}  # what an engine's native answers carry (default: FINGERPRINT)
        self.completions = 0  # native generations asked of them

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = f"{request.url.host}:{request.url.port}"
        if host in self.down:
            raise httpx.ConnectError("refused", request=request)
        if host in self.hung:
            raise httpx.ReadTimeout("timed out", request=request)
        path = request.url.path
        if path == "/health":
            self.health_checks += 1
            return httpx.Response(self.health_status)
        if path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        if path == "/inference/v1/generate":
            return httpx.Response(400, json={"error": {"message": "token_ids: Field required"}})
        if path == "/metrics":
            return httpx.Response(200, text=CACHE_INFO.replace('block_size="128"', f'block_size="{self.block_size}"'))
        if path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if path == "/v1/completions":
            self.completions += 1
            fingerprint = self.fingerprints.get(host, FINGERPRINT)
            return httpx.Response(200, json={"object": "text_completion", "system_fingerprint": fingerprint})
        return httpx.Response(404, json={"detail": "Not Found"})


async def test_a_failed_refresh_keeps_the_last_record_and_backs_off() -> None:
    config = TitoConfig.model_validate(
        {
            "render_config": {"enable": False},
            "pools": [{"instances": [{"port": 1}, {"port": 2}]}],
            "capabilities": {"retry_min_s": 0.5, "retry_max_s": 2.0, "interval_s": 30},
            "scheduler": {"prefix_source": "routing"},
        }
    )
    engines, now = _Engines(), [100.0]
    engines.down.add("127.0.0.1:2")
    scheduler = build_scheduler(config, gated=True)
    tokenization = TokenizationService(None, LocalTokenizer(None))
    async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as http:
        capabilities = Capabilities(config, scheduler, tokenization, http, clock=lambda: now[0])
        await capabilities.refresh()
        assert scheduler.held_out == {"127.0.0.1:2": "no capability record: unreachable: ConnectError: refused"}
        assert capabilities.ready()  # one engine of the pool routes
        assert [capabilities._due[a].at - now[0] for a in ("127.0.0.1:1", "127.0.0.1:2")] == [30, 0.5]
        for expected in (1.0, 2.0, 2.0):  # doubling up to retry_max_s
            await capabilities.refresh(["127.0.0.1:2"])
            assert capabilities._due["127.0.0.1:2"].at - now[0] == expected
        engines.down = {"127.0.0.1:1"}  # the first goes away (held out), the second comes up: it joins
        engines.block_size = 16
        await capabilities.refresh()
        assert scheduler.held_out == {"127.0.0.1:1": "unreachable: ConnectError: refused"}
        stale = capabilities.engines["127.0.0.1:1"]
        assert stale is not None and stale.complete and stale.block_size == 128 and "refused" in str(stale.error)
        # the pool's configured 128 is still what the first engine hashes (out only while it
        # is down): the second's events are not used for the index, and the pool keeps its size
        assert scheduler.block_size(Role.UNION) == 128 and scheduler.events_ignored == {"127.0.0.1:2"}


ONE = "127.0.0.1:1"


def one_engine(**capabilities: object) -> TitoConfig:
    return TitoConfig.model_validate(
        {
            "render_config": {"enable": False},
            "pools": [{"instances": [{"port": 1}]}],
            "capabilities": {"retry_min_s": 0.5, "retry_max_s": 30, "interval_s": 30, **capabilities},
            "scheduler": {"prefix_source": "routing"},
        }
    )


async def test_a_dead_engine_leaves_routing_at_its_first_failed_check_and_comes_back_at_its_first_passing_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config, engines, now = one_engine(), _Engines(), [100.0]
    scheduler = build_scheduler(config, gated=True)
    async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as http:
        capabilities = Capabilities(
            config, scheduler, TokenizationService(None, LocalTokenizer(None)), http, lambda: now[0]
        )
        await capabilities.refresh()
        assert capabilities.ready() and capabilities._due[ONE].at == 130

        engines.down.add(ONE)
        caplog.set_level(logging.INFO, "tito.capabilities")
        await capabilities.check(ONE)
        why = "unreachable: ConnectError: refused"
        assert scheduler.held_out == {ONE: why}
        assert capabilities.unready() == {"union": f"no engine routes ({ONE} {why})"} and not capabilities.ready()
        shown = capabilities.describe_engine(ONE)  # the last good record's facts, and why it is out
        assert (shown["routes"], shown["held_out"], shown["error"]) == (False, why, why)
        assert (shown["version"], shown["served_models"], shown["block_size"]) == ("0.32.0", ["tiny"], 128)
        assert f"engine {ONE} held out: {why}" in caplog.text
        assert capabilities._due[ONE].at == now[0] + 0.5  # its probe, with the backoff
        now[0] += 0.4
        await capabilities.check(ONE)  # still down: the probe is not pushed further out
        assert capabilities._due[ONE].at == 100.5
        for backoff in (1, 2, 4, 8):  # probes that fail back off as before
            await capabilities.refresh([ONE])
            assert capabilities._due[ONE].at == now[0] + backoff and scheduler.held_out == {ONE: why}

        engines.down.clear()  # restarted: its first passing check brings the probe on at once
        await capabilities.check(ONE)
        assert capabilities._due[ONE].at == now[0] and not capabilities.ready()
        await capabilities.refresh([ONE])
        assert capabilities.ready() and scheduler.held_out == {} and capabilities.describe_engine(ONE)["error"] is None
        assert f"engine {ONE} routes, token-only" in caplog.text.split("held out")[-1]
        await capabilities.check(ONE)  # alive and routing: nothing to do
        assert capabilities._due[ONE].at == now[0] + 30


@pytest.mark.parametrize(
    ("fault", "why"),
    [
        ("hung", "unreachable: ReadTimeout: timed out"),
        (503, "unhealthy: GET /health answered 503"),
        (404, None),  # a server without the route is up all the same
    ],
)
async def test_what_a_liveness_check_counts_as_dead(fault: str | int, why: str | None) -> None:
    config, engines = one_engine(), _Engines()
    scheduler = build_scheduler(config, gated=True)
    async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as http:
        capabilities = Capabilities(config, scheduler, TokenizationService(None, LocalTokenizer(None)), http)
        await capabilities.refresh()
        if fault == "hung":
            engines.hung.add(ONE)
            for _ in range(config.capabilities.health_timeouts - 1):  # late answers: not dead yet
                await capabilities.check(ONE)
                assert scheduler.held_out == {}
        else:
            engines.health_status = int(fault)
        await capabilities.check(ONE)
        assert scheduler.held_out == ({ONE: why} if why else {})


async def wait_until(check: Callable[[], bool], timeout: float = 2.0) -> float:
    """Seconds until `check` held (AssertionError after `timeout`)."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def test_the_background_task_notices_a_dead_engine_and_a_restarted_one_within_a_check() -> None:
    """Real time, short intervals: dead within a liveness interval, back within one of its
    restart though its probe had backed off far longer; a hung probe holds up no check."""
    config, engines = one_engine(health_interval_s=0.1, retry_min_s=2, retry_max_s=60), _Engines()
    scheduler = build_scheduler(config, gated=True)
    async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as http:
        capabilities = Capabilities(config, scheduler, TokenizationService(None, LocalTokenizer(None)), http)
        task = asyncio.create_task(capabilities.run())
        try:
            await wait_until(capabilities.ready)
            engines.down.add(ONE)
            assert await wait_until(lambda: not capabilities.ready()) < 0.5
            await asyncio.sleep(0.3)  # checks keep failing; the probe waits out its backoff (2 s)
            checks = engines.health_checks
            engines.down.clear()
            assert await wait_until(capabilities.ready) < 0.5
            assert engines.health_checks > checks
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_a_request_that_failed_on_an_engine_brings_its_check_on_at_once() -> None:
    config, engines = one_engine(health_interval_s=60), _Engines()
    scheduler = build_scheduler(config, gated=True)
    async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as http:
        capabilities = Capabilities(config, scheduler, TokenizationService(None, LocalTokenizer(None)), http)
        planner = Planner(config, None, scheduler)  # type: ignore[arg-type]
        planner.on_engine_failed = capabilities.engine_failed  # as the processor wires it
        task = asyncio.create_task(capabilities.run())
        try:
            await wait_until(capabilities.ready)
            engines.down.add(ONE)
            await asyncio.sleep(0.2)
            assert capabilities.ready()  # the next check is a minute away
            planner.finish("some-lease", failed=(ONE,))  # e.g. Envoy could not connect
            assert await wait_until(lambda: not capabilities.ready()) < 0.5
            assert scheduler.held_out == {ONE: "unreachable: ConnectError: refused"}
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
