"""The Envoy bootstrap and docker-compose file are validated by the real tools."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from ext_proc.config import load_config
from ext_proc.envoy_protocol.bootstrap import render_bootstrap, write_bootstrap
from ext_proc.tools.tiny_model import FORMAT_VERSION
from tests.conftest import missing

ROOT = Path(__file__).resolve().parents[2]


def _validate(envoy_bin: Path, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(envoy_bin), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_generated_bootstrap_passes_envoy_validate(tmp_path: Path, envoy_bin: Path) -> None:
    env = {"TITO__POOLS": "[{name: union, instances: [{port: 8200}, {port: 8201}, {host: 10.1.2.3, port: 8000}]}]"}
    path = write_bootstrap(load_config(env=env), tmp_path / "envoy.yaml")
    result = _validate(envoy_bin, path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


def test_bootstrap_has_the_measured_settings() -> None:
    bootstrap = yaml.safe_load(render_bootstrap(load_config(env={})))
    listener = bootstrap["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["status_on_error"] == {"code": 503}
    assert ext_proc["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert ext_proc["processing_mode"]["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert hcm["delayed_close_timeout"] == "0s"
    # Bodies stream to the processor, which enforces the request limit: Envoy holds little.
    assert listener["per_connection_buffer_limit_bytes"] == 1 << 20
    assert hcm["normalize_path"] and hcm["merge_slashes"]
    assert hcm["path_with_escaped_slashes_action"] == "REJECT_REQUEST"
    assert hcm["request_headers_timeout"] == "10s"
    assert hcm["http_filters"][-1]["typed_config"]["suppress_envoy_headers"] is True
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    public = {(r["match"]["path"], r["match"]["headers"][0]["string_match"]["exact"]) for r in routes if "route" in r}
    assert public == {
        ("/v1/chat/completions", "POST"),
        ("/v1/completions", "POST"),
        ("/v1/models", "GET"),
        ("/health", "GET"),
    }
    assert routes[-1]["match"] == {"prefix": "/"} and routes[-1]["direct_response"]["status"] == 404
    assert [
        c["circuit_breakers"]["thresholds"][0]["max_requests"] for c in bootstrap["static_resources"]["clusters"]
    ] == [
        2048,
        1024,
    ]
    pool = bootstrap["static_resources"]["clusters"][1]
    override = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
    # Routing only from processor metadata: no header source a client could set.
    assert override["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}
    ]


def test_docker_compose_file_is_valid() -> None:
    compose = shutil.which("docker-compose")
    if compose is None:
        missing("docker-compose (Debian package docker-compose)")
    result = subprocess.run(
        [compose, "-f", str(ROOT / "docker-compose.yml"), "config", "-q"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_gateway_config_matches_the_compose_services() -> None:
    config = load_config(ROOT / "tito.compose.yaml", env={})
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]

    def ip(name: str) -> str:
        return str(services[name]["networks"]["tito"]["ipv4_address"])

    assert config.processor.host == ip("processor")
    assert config.render_config.endpoint.host == ip("render")
    assert [i.host for i in config.pools[0].instances] == [ip("engine")]
    # the model the one-shot `model` service generates is the one everything loads
    assert config.model.path == f"/models/tiny-qwen3-v{FORMAT_VERSION}"
    for name in ("render", "engine"):
        assert f"--model={config.model.path}" in services[name]["command"]
