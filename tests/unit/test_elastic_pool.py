"""`tito up`'s elastic local pool (ext_proc/tools/elastic_pool.py): which pools it runs, the
dnsmasq it starts, its engines' loopback addresses and hosts records, and the scale and state
files `tito scale` and `tito up` exchange. No processes, no network."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
from pathlib import Path

import pytest

from ext_proc.config import InstanceConfig, PoolConfig, TitoConfig
from ext_proc.tools.elastic_pool import (
    LOCAL_POOL,
    SCALE_FILE,
    STATE_FILE,
    ElasticPool,
    dnsmasq_command,
    elastic_by_default,
    idle,
    read_scale,
    read_state,
    request_scale,
    runs_locally,
)


def _dns(nameserver: str | None, **discovery: object) -> PoolConfig:
    return PoolConfig.model_validate(
        {
            "discovery": {
                "source": "dns",
                "name": "engines.tito.test",
                "port": 8200,
                "nameserver": nameserver,
                **discovery,
            }
        }
    )


@pytest.mark.parametrize(
    ("nameserver", "local"),
    [
        ("127.0.0.1:8053", True),
        ("127.0.0.53:53", True),  # all of 127.0.0.0/8
        ("localhost:8053", True),
        ("[::1]:53", True),
        ("10.0.0.2:53", False),
        ("[fd00::2]:53", False),
        ("dns.example.com:53", False),
        (None, False),  # the system's resolvers
    ],
)
def test_a_dns_pool_runs_locally_when_its_name_server_is_on_loopback(nameserver: str | None, local: bool) -> None:
    assert runs_locally(_dns(nameserver)) is local


def test_a_static_or_kubernetes_pool_never_runs_locally() -> None:
    assert not runs_locally(PoolConfig.model_validate({"instances": [{"port": 8200}]}))
    kubernetes = {"source": "kubernetes", "selector": {"app": "vllm"}, "api_url": "http://127.0.0.1:8001"}
    assert not runs_locally(PoolConfig.model_validate({"discovery": kubernetes}))


def test_dnsmasq_answers_from_the_hosts_folder_for_each_pool_domain(tmp_path: Path) -> None:
    names = ["engines.tito.test", "prefill.tito.test", "decode.other.test", "bare"]
    command = dnsmasq_command("127.0.0.1:8053", tmp_path / "hosts", names)
    assert command[0].endswith("dnsmasq")
    flags = command[1:]
    for flag in (
        "--port=8053",
        "--listen-address=127.0.0.1",
        f"--hostsdir={tmp_path / 'hosts'}",
        "--local-ttl=1",
        "--no-resolv",
        "--no-hosts",
        "--keep-in-foreground",
    ):
        assert flag in flags, flag
    # one --local per domain (the pools' names without their first label), authoritative there
    assert [f for f in flags if f.startswith("--local=")] == [
        "--local=/bare/",
        "--local=/other.test/",
        "--local=/tito.test/",
    ]
    assert ("--user=root" in flags) == (os.geteuid() == 0)


def test_dnsmasq_listens_on_an_ipv6_loopback_without_brackets(tmp_path: Path) -> None:
    flags = dnsmasq_command("[::1]:5353", tmp_path, ["engines.tito.test"])
    assert "--listen-address=::1" in flags and "--port=5353" in flags


def _elastic(wanted: int = 3, **discovery: object) -> ElasticPool:
    pool = _dns("127.0.0.1:8053", **discovery)
    return ElasticPool("union", TitoConfig(), pool, "engine", wanted)


def test_engine_k_listens_on_its_own_loopback_address_at_the_pool_port() -> None:
    pool = _elastic(kv_events_port=5557)
    pool.size = 3
    assert [(name, i.address) for name, i in pool.engines()] == [
        ("engine0", "127.0.0.11:8200"),
        ("engine1", "127.0.0.12:8200"),
        ("engine2", "127.0.0.13:8200"),
    ]
    events = pool.instance(1).kv_events
    assert events is not None and events.endpoint == "tcp://127.0.0.12:5557"


def test_only_listed_engines_have_a_record_and_each_state_is_described() -> None:
    pool = _elastic(wanted=2)
    assert pool.records() == "" and pool.describe() == {"wanted": 2, "listed": [], "starting": [], "draining": []}
    pool.size, pool.listed, pool.draining = 4, {2, 0}, {3: 10.0}
    assert pool.records() == "127.0.0.11 engines.tito.test\n127.0.0.13 engines.tito.test\n"
    assert pool.describe() == {
        "wanted": 2,
        "listed": ["127.0.0.11:8200", "127.0.0.13:8200"],
        "starting": ["127.0.0.12:8200"],  # started, not answering yet
        "draining": ["127.0.0.14:8200"],  # unlisted, stopped once idle
    }


def test_tito_up_runs_the_elastic_local_pool_only_when_no_pools_are_configured() -> None:
    default = elastic_by_default(TitoConfig.model_validate({"model": {"served_name": "m"}}))
    (pool,) = default.pools
    assert pool == PoolConfig.model_validate(LOCAL_POOL) and runs_locally(pool)
    assert default.model.served_name == "m"  # the rest of the config kept
    for pools in ([{"instances": [{"port": 8200}]}], [PoolConfig().model_dump()]):  # even the default, stated
        config = TitoConfig.model_validate({"pools": pools})
        assert elastic_by_default(config) is config


def test_scale_requests_round_trip_and_keep_other_pools(tmp_path: Path) -> None:
    assert read_scale(tmp_path) == {}
    request_scale(tmp_path, "union", 3)
    request_scale(tmp_path, "m2/decode", 1)
    request_scale(tmp_path, "union", 0)
    assert read_scale(tmp_path) == {"union": 0, "m2/decode": 1}
    assert sorted(os.listdir(tmp_path)) == [SCALE_FILE]  # written whole, no temp file left


@pytest.mark.parametrize("text", ["", "{", "not json", "[1, 2]", "null", '{"union": "three"}'])
def test_a_garbled_scale_file_reads_as_no_request(tmp_path: Path, text: str) -> None:
    (tmp_path / SCALE_FILE).write_text(text)
    assert read_scale(tmp_path) == {}
    request_scale(tmp_path, "union", 2)  # and is replaced by the next request
    assert read_scale(tmp_path) == {"union": 2}


def test_the_pools_state_round_trips_and_a_missing_or_garbled_one_is_empty(tmp_path: Path) -> None:
    assert read_state(tmp_path) == {}
    state = {"union": _elastic(wanted=1).describe()}
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    assert read_state(tmp_path) == state
    (tmp_path / STATE_FILE).write_text('{"union": {"wanted": 1, "listed": [')  # cut short
    assert read_state(tmp_path) == {}


class _Metrics(http.server.BaseHTTPRequestHandler):
    """An engine's /metrics: vLLM's two gauges, or no answer within the idle check's timeout."""

    running = 0.0
    stall_s = 0.0

    def do_GET(self) -> None:
        time.sleep(self.stall_s)
        body = f'vllm:num_requests_running{{model_name="tiny"}} {self.running}\nvllm:num_requests_waiting{{model_name="tiny"}} 0.0\n'
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(("running", "stall_s", "expected"), [(0.0, 0, True), (3.0, 0, False), (0.0, 3, False)])
def test_a_draining_engine_is_idle_when_it_runs_nothing_and_not_while_too_busy_to_answer(
    running: float, stall_s: float, expected: bool
) -> None:
    handler = type("Handler", (_Metrics,), {"running": running, "stall_s": stall_s})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        instance = InstanceConfig(host="127.0.0.1", port=port)
        assert idle(instance) is expected
    finally:
        server.shutdown()
        server.server_close()
    assert idle(instance)  # nothing listens there any more: gone, so idle
