from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from ext_proc.config import load_config


def test_defaults_work_locally() -> None:
    config = load_config(env={})
    assert config.render_config.timeout_ms == 5000
    assert config.render_config.renderer_num_workers == 4
    assert config.pools[0].role == "union"
    assert config.pools[0].instances[0].address == "127.0.0.1:8200"


def test_file_then_env_overrides(tmp_path: Path) -> None:
    path = tmp_path / "tito.yaml"
    path.write_text("model: {served_name: big, max_model_len: 4096}\nrender_config: {timeout_ms: 100}\n")
    env = {
        "TITO__RENDER_CONFIG__ENDPOINT__PORT": "8101",
        "TITO__MODEL__MAX_MODEL_LEN": "8192",
        "TITO__POOLS": "[{name: u, instances: [{host: 10.0.0.1, port: 9}, {port: 10}]}]",
        "UNRELATED": "x",
    }
    config = load_config(path, env)
    assert config.model.served_name == "big"
    assert config.model.max_model_len == 8192
    assert config.render_config.timeout_ms == 100
    assert config.render_config.endpoint.port == 8101
    assert [i.address for i in config.pools[0].instances] == ["10.0.0.1:9", "127.0.0.1:10"]


def test_config_file_from_env_var(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("listener: {port: 1234}\n")
    assert load_config(env={"TITO_CONFIG": str(path)}).listener.port == 1234


def test_typos_are_rejected() -> None:
    with pytest.raises(ValidationError):
        load_config(env={"TITO__RENDER_CONFIG__TIMEOUT": "5"})


def test_yaml_round_trip(tmp_path: Path) -> None:
    config = load_config(env={"TITO__MODEL__REASONING_PARSER": "qwen3"})
    path = tmp_path / "dump.yaml"
    path.write_text(config.to_yaml())
    assert load_config(path, env={}) == config


def test_the_public_route_table_decides_who_answers() -> None:
    listener = load_config(env={}).listener
    assert listener.handler("POST", "/v1/chat/completions?x=1") == "chat"
    assert listener.handler("POST", "/v1/completions") == "completions"
    assert listener.handler("GET", "/v1/models") == "models"  # the model catalog answers it
    assert listener.handler("GET", "/health") == "health"
    assert listener.handler("GET", "/v1/chat/completions") is None
    assert listener.handler("POST", "/inference/v1/generate") is None
    duplicate = "[{method: GET, path: /h, handler: health}, {method: GET, path: /h, handler: passthrough}]"
    with pytest.raises(ValidationError):
        load_config(env={"TITO__LISTENER__ROUTES": duplicate})


def test_handoff_and_trigger_instances_cannot_share_a_decode_pool() -> None:
    pools = "[{name: p, role: prefill, instances: [{port: 1}]}, {name: d, role: decode, instances: [{port: 2}, {port: 3, capabilities: [concurrent_engine_sync]}]}]"
    with pytest.raises(ValidationError, match="cannot be mixed"):
        load_config(env={"TITO__POOLS": pools})
    load_config(env={"TITO__POOLS": pools.replace("{port: 2}", "{port: 2, capabilities: [concurrent_engine_sync]}")})


def test_each_worker_takes_the_next_port_pair() -> None:
    processor = load_config(env={"TITO__PROCESSOR__WORKERS": "3"}).processor
    assert processor.worker_ports() == [(9002, 9003), (9004, 9005), (9006, 9007)]
    second = processor.for_worker(1)
    assert (second.port, second.admin_port, second.worker_index) == (9004, 9005, 1)
    assert second.worker_ports() == processor.worker_ports()  # every worker sees the same set
    with pytest.raises(ValidationError, match="9004"):  # worker 1's gRPC port would be worker 0's admin port
        load_config(env={"TITO__PROCESSOR__WORKERS": "2", "TITO__PROCESSOR__ADMIN_PORT": "9004"})


def test_admission_budgets_are_split_between_every_processor_process() -> None:
    env = {"TITO__ADMISSION__GLOBAL_TOKEN_BUDGET": "10001", "TITO__ADMISSION__INSTANCE_TOKEN_BUDGET": "3000"}
    assert load_config(env=env).process_token_budgets == (10001, 3000)
    split = load_config(env={**env, "TITO__PROCESSOR__WORKERS": "2", "TITO__ADMISSION__REPLICAS": "3"})
    assert split.process_token_budgets == (1666, 500)  # 6 processes: their shares never exceed the budget
    assert load_config(env={"TITO__PROCESSOR__WORKERS": "2"}).process_token_budgets == (None, None)


def test_the_render_pool_is_its_endpoints_or_replicas_from_the_first_port() -> None:
    assert [e.address for e in load_config(env={}).render_config.pool()] == ["127.0.0.1:8100"]
    replicas = load_config(env={"TITO__RENDER_CONFIG__REPLICAS": "3"}).render_config
    assert [e.address for e in replicas.pool()] == ["127.0.0.1:8100", "127.0.0.1:8101", "127.0.0.1:8102"]
    listed = load_config(
        env={"TITO__RENDER_CONFIG__ENDPOINTS": "[{host: r1, port: 80}, {host: r2, port: 81, timeout_ms: 200}]"}
    )
    render = listed.render_config
    assert [(e.address, e.timeout_ms) for e in render.pool()] == [("r1:80", None), ("r2:81", 200)]
    assert render.endpoint.address == "r1:80"  # the first endpoint (derender's sidecar mode uses it)
    with pytest.raises(ValidationError):
        load_config(env={"TITO__RENDER_CONFIG__REPLICAS": "0"})
