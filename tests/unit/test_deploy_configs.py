"""The Envoy bootstrap, docker-compose file and deploy/ manifests are validated by the real
tools (Envoy, docker-compose, Kubernetes' schemas) and checked against the gateway config."""

from __future__ import annotations

import copy
import importlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from ext_proc.config import InstanceConfig, PoolConfig, TitoConfig, load_config
from ext_proc.envoy_protocol.bootstrap import render_bootstrap, write_bootstrap
from ext_proc.observability.metrics import _flow_gauges
from ext_proc.tools.tiny_model import FORMAT_VERSION
from render_sidecar.launch import engine_command
from tests.conftest import missing

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.30.0"  # the oldest cluster the manifests are meant for
# Istio's CRDs (networking.istio.io): not in kubernetes-validate's schemas, checked field by
# field below.
ISTIO_KINDS = {"EnvoyFilter", "Gateway", "VirtualService"}
# The Gateway API Inference Extension's CRD, likewise.
INFERENCE_POOL = ("inference.networking.k8s.io/v1", "InferencePool")
# The Gateway API's (deploy/gie), likewise. Its Gateway is not Istio's Gateway of the same
# kind name: the apiVersion tells them apart.
GATEWAY_API = "gateway.networking.k8s.io/v1"
GATEWAY_API_KINDS = {"Gateway", "HTTPRoute"}
# deploy/gie: tito as an InferencePool's endpoint picker. base/ is what every GIE gateway
# shares; each gateway's folder adds its Gateway (its gatewayClassName).
GIE = DEPLOY / "gie"
GIE_GATEWAYS = {"istio": "istio", "agentgateway": "agentgateway"}
DOCKER_DNS = "127.0.0.11:53"  # Docker's embedded DNS, in every container of a user network


def _validate(envoy_bin: Path, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(envoy_bin), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_generated_bootstrap_passes_envoy_validate(tmp_path: Path, envoy_bin: Path) -> None:
    env = {
        "TITO__POOLS": "[{name: union, instances: [{port: 8200}, {port: 8201}, {host: 10.1.2.3, port: 8000}]}]",
        "TITO__PROCESSOR__WORKERS": "2",
    }
    path = write_bootstrap(load_config(env=env), tmp_path / "envoy.yaml")
    result = _validate(envoy_bin, path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr
    # Envoy balances streams over every processor worker and health-checks each one's admin port.
    (cluster,) = [
        c for c in yaml.safe_load(path.read_text())["static_resources"]["clusters"] if c["name"] == "ext_proc"
    ]
    endpoints = [e["endpoint"] for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    ports = [(e["address"]["socket_address"]["port_value"], e["health_check_config"]["port_value"]) for e in endpoints]
    assert ports == [(9002, 9003), (9004, 9005)] and cluster["lb_policy"] == "ROUND_ROBIN"


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
    public = {
        (r["match"].get("path") or r["match"]["safe_regex"]["regex"], r["match"]["headers"][0]["string_match"]["exact"])
        for r in routes
        if "route" in r
    }
    stored = "/v1/responses/(?P<response_id>[^/]+)"
    assert public == {
        ("/v1/chat/completions", "POST"),
        ("/v1/completions", "POST"),
        ("/v1/messages", "POST"),
        ("/v1/messages/count_tokens", "POST"),
        ("/v1/responses", "POST"),
        (stored, "GET"),
        (stored, "DELETE"),
        (stored + "/input_items", "GET"),
        (stored + "/cancel", "POST"),
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


def _docker_compose() -> str:
    compose = shutil.which("docker-compose")
    if compose is None:
        missing("docker-compose (Debian package docker-compose)")
        raise AssertionError("missing() skips or fails")
    return compose


@pytest.mark.parametrize("profile", [[], ["--profile", "tracing"]], ids=["default", "tracing"])
def test_docker_compose_file_is_valid(profile: list[str]) -> None:
    result = subprocess.run(
        [_docker_compose(), "-f", str(ROOT / "docker-compose.yml"), *profile, "config", "-q"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_gateway_config_matches_the_compose_services() -> None:
    config = load_config(ROOT / "tito.compose.yaml", env={})
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]

    def ip(name: str) -> str:
        return str(services[name]["networks"]["tito"]["ipv4_address"])

    assert config.processor.host == ip("processor")
    assert config.render_config.endpoint.host == ip("render")
    assert config.pools[0].discovery.name == "engine"
    # the models the one-shot `model` service generates are the ones everything loads: two
    # base models, each with its render sidecar and engine
    (second,) = config.models
    assert config.model.path == f"/models/tiny-qwen3-v{FORMAT_VERSION}"
    assert second.model.path == f"/models/tiny-qwen3-v{FORMAT_VERSION}-vocab768"
    assert services["model"]["command"][-3:] == ["--vocab-size", "1024", "768"]
    assert second.render_config.endpoint.host == ip("render-b")
    assert second.pools[0].discovery.name == "engine-b"
    for base, suffix in ((config.model, ""), (second.model, "-b")):
        for name in ("render", "engine"):
            assert f"--model={base.path}" in services[name + suffix]["command"]
            assert f"--served-model-name={base.served_name}" in services[name + suffix]["command"]


def _discovered_instance(pool: PoolConfig) -> InstanceConfig:
    """What the processor makes of an instance its discovery finds (any address will do)."""
    assert pool.discovery.dynamic and not pool.instances
    return pool.discovered("10.0.0.7", pool.discovery.port)


def _kv_event_ports(config: TitoConfig) -> set[int]:
    (pool,) = config.pools
    events = _discovered_instance(pool).kv_events
    assert events is not None
    return {int(e.rsplit(":", 1)[1]) for e in (events.endpoint, events.replay_endpoint)}


def _assert_publishes_kv_events(args: list[str], config: TitoConfig) -> None:
    """The engine's flags are what `tito up` gives an engine of this config: its block size,
    the hash the processor recomputes, and events on the ports the processor subscribes to
    (on every instance its discovery finds)."""
    (pool,) = config.pools
    instance = _discovered_instance(pool)
    assert instance.kv_events is not None
    expected = engine_command(
        config.model, "m", instance.host, instance.port, kv_events=instance.kv_events, block_size=pool.block_size
    )
    flags = dict(a.removeprefix("--").split("=", 1) for a in args if "=" in a)
    assert flags["block-size"] == expected[expected.index("--block-size") + 1]
    assert flags["prefix-caching-hash-algo"] == "sha256_cbor"
    events = json.loads(expected[expected.index("--kv-events-config") + 1])
    assert json.loads(flags["kv-events-config"]) == events


def test_compose_engine_publishes_the_kv_events_the_processor_subscribes_to() -> None:
    config = load_config(ROOT / "tito.compose.yaml", env={})
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    _assert_publishes_kv_events(services["engine"]["command"], config)
    assert config.scheduler.prefix_source == "kv_events"


def _replicas(service: dict[str, Any]) -> int:
    """A compose service's replicas: deploy.replicas or scale (docker-compose refuses both)."""
    return int(service.get("deploy", {}).get("replicas", service.get("scale", 1)))


def test_compose_engines_are_replicas_found_by_docker_dns() -> None:
    config = load_config(ROOT / "tito.compose.yaml", env={})
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for base in config.bases():
        (pool,) = base.pools
        # every replica of the service its name names, on the port the engines listen on
        assert pool.discovery.source == "dns" and pool.discovery.nameserver == DOCKER_DNS
        engine = services[pool.discovery.name]
        assert f"--port={pool.discovery.port}" in engine["command"]
        assert f"--served-model-name={base.model.served_name}" in engine["command"]
        # replicas share the service's name: no fixed address or container name to collide
        assert "container_name" not in engine
        networks = engine.get("networks", [])
        if isinstance(networks, dict):
            assert not any((n or {}).get("ipv4_address") for n in networks.values())
    assert _replicas(services[config.pools[0].discovery.name]) > 1
    # the resolved file keeps them (docker-compose drops what it does not know)
    result = subprocess.run(
        [_docker_compose(), "-f", str(ROOT / "docker-compose.yml"), "config"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert _replicas(yaml.safe_load(result.stdout)["services"][config.pools[0].discovery.name]) > 1


def _named_mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """A compose service's volumes by container path: (source, read-only)."""
    mounts: dict[str, tuple[str, bool]] = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        mounts[target] = (source, mode == ["ro"])
    return mounts


def test_compose_envoy_and_processor_share_the_endpoints_file() -> None:
    config = load_config(ROOT / "tito.compose.yaml", env={})
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    folder = str(Path(config.listener.engine_endpoints_file).parent)
    envoy, processor, writer = (
        _named_mounts(compose["services"][name]) for name in ("envoy", "processor", "envoy-config")
    )
    # one named volume: the processor writes the endpoints there, Envoy watches them, and the
    # bootstrap writer leaves the first file there (Envoy refuses a missing one)
    assert envoy[folder][0] == processor[folder][0] == writer[folder][0] in compose["volumes"]
    assert processor[folder][1] is False and writer[folder][1] is False
    assert compose["services"]["envoy"]["depends_on"]["envoy-config"] == {"condition": "service_completed_successfully"}


def test_tracing_is_opt_in_and_reaches_the_tracing_profile() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert {name for name, s in services.items() if "profiles" in s} == {"jaeger"}
    assert services["jaeger"]["profiles"] == ["tracing"]
    # unset (tracing off) unless the caller sets it: deploy/README.md's command
    endpoint = f"http://{services['jaeger']['networks']['tito']['ipv4_address']}:4317"
    result = subprocess.run(
        [_docker_compose(), "-f", str(ROOT / "docker-compose.yml"), "--profile", "tracing", "config"],
        capture_output=True,
        text=True,
        env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    resolved = yaml.safe_load(result.stdout)["services"]["processor"]["environment"]
    assert resolved == {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "tito-processor"}
    assert services["processor"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${OTEL_EXPORTER_OTLP_ENDPOINT:-}"


def test_prometheus_scrapes_the_compose_admin_ports() -> None:
    config = load_config(ROOT / "tito.compose.yaml", env={})
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}

    def targets(job: str) -> list[str]:
        return [target for static in jobs[job]["static_configs"] for target in static["targets"]]

    assert targets("tito-processor") == [f"processor:{config.processor.admin_port}"]
    assert jobs["tito-processor"].get("metrics_path", "/metrics") == "/metrics"
    assert targets("envoy") == [f"envoy:{config.listener.admin_port}"]
    assert jobs["envoy"]["metrics_path"] == "/stats/prometheus"
    admin = yaml.safe_load(render_bootstrap(config))["admin"]["address"]["socket_address"]
    assert admin["address"] == "0.0.0.0"  # Envoy's admin reachable from the Prometheus container
    assert {target.split(":")[0] for job in jobs for target in targets(job)} <= set(services)
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]


# deploy/kubernetes, deploy/istio and deploy/gie


def _documents(folder: Path) -> list[dict[str, Any]]:
    """The objects of a folder's manifests (its kustomization.yaml is kustomize's, not the cluster's)."""
    documents: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            documents += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return documents


def _all_documents() -> list[dict[str, Any]]:
    return _documents(DEPLOY / "kubernetes") + _documents(DEPLOY / "istio")


def _gie_documents(gateway: str | None = None) -> list[dict[str, Any]]:
    """deploy/gie/base's objects, with those of a gateway's folder (deploy/gie/<gateway>)."""
    return _documents(GIE / "base") + (_documents(GIE / gateway) if gateway else [])


def _manifest_documents() -> list[dict[str, Any]]:
    """Every object of every deploy/ folder (each once: deploy/gie itself only names base/)."""
    return _all_documents() + _gie_documents() + [d for g in GIE_GATEWAYS for d in _documents(GIE / g)]


def _crd(document: dict[str, Any]) -> bool:
    """An object of a CRD (checked field by field below), not of a built-in kind."""
    api, kind = document["apiVersion"], document["kind"]
    return (
        (api.split("/")[0] == "networking.istio.io" and kind in ISTIO_KINDS)
        or (api, kind) == INFERENCE_POOL
        or (api == GATEWAY_API and kind in GATEWAY_API_KINDS)
    )


def _object(kind: str, name: str, documents: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    documents = _all_documents() if documents is None else documents
    found = [d for d in documents if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def _container(deployment: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    pod = deployment["spec"]["template"]["spec"]
    return next(c for c in pod["initContainers" if init else "containers"] if c["name"] == name)


def _port(container: dict[str, Any], ref: int | str) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(ref, int):
        return ref
    return int(next(p["containerPort"] for p in container["ports"] if p["name"] == ref))


def _selected(service: dict[str, Any], documents: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Deployment whose pods a Service selects (one, in these manifests)."""
    selector = service["spec"]["selector"].items()
    (deployment,) = [
        d
        for d in (_all_documents() if documents is None else documents)
        if d["kind"] == "Deployment" and selector <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    return deployment


def _backend_port(
    service: dict[str, Any], name: str | None = None, documents: list[dict[str, Any]] | None = None
) -> int:
    """The container port a Service's port (its only one, or the one named) reaches, through
    its selector and targetPort."""
    deployment = _selected(service, documents)
    (port,) = [p for p in service["spec"]["ports"] if name in (None, p["name"])]
    target = port["targetPort"]
    (backend,) = [
        p["containerPort"]
        for c in deployment["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
        if target in (p["name"], p["containerPort"])
    ]
    return int(backend)


def _cluster_config(tmp_path: Path) -> TitoConfig:
    path = tmp_path / "tito.yaml"
    path.write_text(_object("ConfigMap", "tito-config")["data"]["tito.yaml"])
    return load_config(path, env={})


def _http_filters(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters: list[dict[str, Any]] = hcm["http_filters"]
    return filters


def _mesh_patch(applies_to: str = "HTTP_FILTER") -> dict[str, Any]:
    patches = _object("EnvoyFilter", "tito-ext-proc")["spec"]["configPatches"]
    (patch,) = [p for p in patches if p["applyTo"] == applies_to]
    return dict(patch)


def _kubernetes_validate() -> ModuleType:
    try:
        return importlib.import_module("kubernetes_validate")
    except ImportError:
        missing("kubernetes-validate (the test extra: pip install -e '.[test]')")
        raise


def test_manifests_pass_the_kubernetes_schemas() -> None:
    kubernetes_validate = _kubernetes_validate()
    kinds = set()
    crds = set()
    for document in _manifest_documents():
        if _crd(document):
            crds.add((document["apiVersion"], document["kind"]))
            continue
        name = f"{document['kind']}/{document['metadata']['name']}"
        try:
            # strict: an unknown or misplaced field is an error, not silently dropped by the API server
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{name}: {'.'.join(map(str, error.path))}: {error.message}")
        kinds.add(document["kind"])
    assert kinds == {"Namespace", "ConfigMap", "Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"}
    # every CRD object is one of the kinds the tests below check field by field
    assert crds == {
        ("networking.istio.io/v1alpha3", "EnvoyFilter"),
        ("networking.istio.io/v1", "Gateway"),
        ("networking.istio.io/v1", "VirtualService"),
        INFERENCE_POOL,
        (GATEWAY_API, "Gateway"),
        (GATEWAY_API, "HTTPRoute"),
    }


@pytest.mark.parametrize(
    ("folder", "bases"),
    [
        ("kubernetes", []),
        ("istio", ["../kubernetes"]),
        # deploy/gie: base/ only; each gateway's folder: base/ and its Gateway (an overlay may
        # not name its parent folder: kustomize reports a cycle)
        ("gie", ["base"]),
        ("gie/base", []),
        ("gie/istio", ["../base"]),
        ("gie/agentgateway", ["../base"]),
    ],
)
def test_kustomization_lists_every_manifest(folder: str, bases: list[str]) -> None:
    kustomization = yaml.safe_load((DEPLOY / folder / "kustomization.yaml").read_text())
    manifests = [p.name for p in (DEPLOY / folder).glob("*.yaml") if p.name != "kustomization.yaml"]
    assert sorted(kustomization["resources"]) == sorted(bases + manifests)


def test_cluster_config_loads_and_its_bootstrap_passes_envoy_validate(tmp_path: Path, envoy_bin: Path) -> None:
    config = _cluster_config(tmp_path)
    # one pod: Envoy, processor and render meet on loopback; the kubelet probes the pod's IP
    assert (config.processor.host, config.render_config.endpoint.host) == ("127.0.0.1", "127.0.0.1")
    assert config.processor.listen_host == config.listener.host == "0.0.0.0"
    # the pod's shared folder does not exist here: the endpoints file in this test's own
    config.listener.engine_endpoints_file = str(tmp_path / "run" / "engines.eds.json")
    result = _validate(envoy_bin, write_bootstrap(config, tmp_path / "envoy.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_gateway_pod_is_wired_as_its_config_says(tmp_path: Path) -> None:
    config = _cluster_config(tmp_path)
    gateway = _object("Deployment", "tito-gateway")
    envoy, processor, render = (_container(gateway, name) for name in ("envoy", "processor", "render"))
    envoy_config = _container(gateway, "envoy-config", init=True)
    # the bootstrap the initContainer writes from the mounted config is the one Envoy loads
    assert envoy_config["args"][:3] == ["--config", "/etc/tito/tito.yaml", "envoy-config"]
    assert envoy["command"][-2:] == ["-c", envoy_config["args"][envoy_config["args"].index("--out") + 1]]
    assert processor["args"] == ["--config", "/etc/tito/tito.yaml", "processor"]
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    for container in (envoy_config, processor):
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/tito"]
        assert volumes[mount["name"]]["configMap"]["name"] == "tito-config"
    assert _port(processor, "grpc") == config.processor.port
    assert f"--port={config.render_config.endpoint.port}" in render["args"]
    assert _backend_port(_object("Service", "tito-gateway")) == config.listener.port
    assert _backend_port(_object("Service", "tito-metrics")) == config.processor.admin_port


def test_processor_probes_use_the_admin_routes(tmp_path: Path) -> None:
    config = _cluster_config(tmp_path)
    processor = _container(_object("Deployment", "tito-gateway"), "processor")
    probes = {kind: processor[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    # /ready drops the pod from the Service while draining; /health restarts only a dead process
    assert {kind: probe["path"] for kind, probe in probes.items()} == {
        "startupProbe": "/health",
        "livenessProbe": "/health",
        "readinessProbe": "/ready",
    }
    assert {_port(processor, probe["port"]) for probe in probes.values()} == {config.processor.admin_port}


def test_gateway_pod_outlives_the_processor_drain(tmp_path: Path) -> None:
    config = _cluster_config(tmp_path)
    drain = config.processor.drain_timeout_s
    gateway = _object("Deployment", "tito-gateway")
    grace = gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    wait = _container(gateway, "envoy")["lifecycle"]["preStop"]["exec"]["command"]
    assert wait[0] == "sleep"
    # Envoy carries the streams the processor finishes; the kubelet kills neither before
    assert drain < int(wait[1]) < grace
    # in the mesh the pod's sidecar carries the ingress gateway's ext_proc streams as well
    patches = [
        yaml.safe_load(p["patch"])
        for p in yaml.safe_load((DEPLOY / "istio" / "kustomization.yaml").read_text())["patches"]
    ]
    (deployment,) = [p for p in patches if p["kind"] == "Deployment"]
    assert deployment["metadata"]["name"] == "tito-gateway"
    proxy = yaml.safe_load(deployment["spec"]["template"]["metadata"]["annotations"]["proxy.istio.io/config"])
    assert drain < int(proxy["terminationDrainDuration"].removesuffix("s")) < grace


def _inference_pool(pool: PoolConfig, namespace: str) -> dict[str, Any]:
    """The InferencePool a discovered pool of the cluster config names, in the manifests."""
    assert pool.discovery.source == "kubernetes" and pool.discovery.inference_pool is not None
    assert pool.discovery.namespace == namespace
    found = _object(INFERENCE_POOL[1], pool.discovery.inference_pool)
    assert found["metadata"]["namespace"] == namespace
    return found


def _assert_pool_is_the_deployments_pods(
    inference_pool: dict[str, Any], deployment: dict[str, Any], documents: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The InferencePool (a CRD kubernetes-validate does not know) checked field by field, as
    the v1 API reads it: its pods are the Deployment's, on the engine's port, and it names an
    endpoint picker Service port that reaches the processor. Returns that Service."""
    assert (inference_pool["apiVersion"], inference_pool["kind"]) == INFERENCE_POOL
    spec = inference_pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    assert spec["selector"] == {"matchLabels": deployment["spec"]["template"]["metadata"]["labels"]}
    assert spec["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    engine = _container(deployment, "engine")
    # one target port (v1.0 allows one), the one the engine serves on
    assert [p["number"] for p in spec["targetPorts"]] == [_port(engine, "http")]
    assert f"--port={_port(engine, 'http')}" in engine["args"]
    picker = spec["endpointPickerRef"]
    assert set(picker) <= {"group", "kind", "name", "port", "failureMode"}
    assert (picker.get("group", ""), picker.get("kind", "Service")) == ("", "Service")
    assert picker.get("failureMode", "FailClose") == "FailClose"  # fail closed, as tito's Envoy
    # a Service's port (not its targetPort, a CEL rule of the API), reaching the processor's gRPC port
    service = _object("Service", picker["name"], documents)
    assert service["metadata"]["namespace"] == inference_pool["metadata"]["namespace"]  # no namespace field
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == picker["port"]["number"]]
    processor = _container(_selected(service, documents), "processor")
    assert _backend_port(service, port["name"], documents) == _port(processor, "grpc")
    return service


def test_cluster_pools_are_discovered_from_inference_pools(tmp_path: Path) -> None:
    config = _cluster_config(tmp_path)
    pools = {d["metadata"]["name"] for d in _all_documents() if d["kind"] == INFERENCE_POOL[1]}
    named = set()
    for base in config.bases():
        for pool in base.pools:
            # no hand-listed engine: the InferencePool's Ready pods
            inference_pool = _inference_pool(pool, "tito")
            named.add(inference_pool["metadata"]["name"])
            # each pool's pods are the engines of its own base model
            deployment = _object("Deployment", inference_pool["metadata"]["name"])
            assert f"--served-model-name={base.model.served_name}" in _container(deployment, "engine")["args"]
            _assert_pool_is_the_deployments_pods(inference_pool, deployment)
    assert named == pools  # and no InferencePool the gateway does not read
    # nothing pins an address any more: engines come and go with their Deployments
    services = [d for d in _all_documents() if d["kind"] == "Service"]
    assert not [s["metadata"]["name"] for s in services if s["spec"].get("clusterIP") not in (None, "None")]


def test_the_commented_dns_alternative_names_the_headless_services(tmp_path: Path) -> None:
    """tito-config's commented `source: dns` lines (clusters without the CRD), swapped in for
    the kubernetes ones, load and find the same pods through the headless Services."""
    found = _cluster_config(tmp_path)
    lines = _object("ConfigMap", "tito-config")["data"]["tito.yaml"].splitlines()
    swapped = 0
    for i, line in enumerate(lines):
        if line.lstrip().startswith("discovery: {source: kubernetes"):
            (alternative,) = [a for a in lines[i + 1 : i + 3] if a.lstrip().startswith("# discovery: {source: dns")]
            lines[i] = line[: len(line) - len(line.lstrip())] + alternative.lstrip().removeprefix("# ")
            swapped += 1
    path = tmp_path / "dns.yaml"
    path.write_text("\n".join(lines) + "\n")
    config = load_config(path, env={})
    assert swapped == len(config.bases())
    for base, by_pool in zip(config.bases(), found.bases(), strict=True):
        ((pool,), (kubernetes,)) = (base.pools, by_pool.pools)
        assert pool.discovery.source == "dns" and pool.discovery.kv_events_port == kubernetes.discovery.kv_events_port
        name, namespace, *rest = pool.discovery.name.split(".")
        assert rest == ["svc", "cluster", "local"] and namespace == kubernetes.discovery.namespace
        assert name == kubernetes.discovery.inference_pool  # the Service beside the pool, same pods
        service = _object("Service", name)
        assert service["spec"]["clusterIP"] == "None"  # a record per pod, not one clusterIP
        assert service["spec"]["selector"] == _object(INFERENCE_POOL[1], name)["spec"]["selector"]["matchLabels"]
        assert _backend_port(service, "http") == pool.discovery.port


def test_the_discovery_role_grants_only_reading_pods_and_pools(tmp_path: Path) -> None:
    _assert_reads_only_pods_and_pools(_cluster_config(tmp_path), _all_documents(), "tito-gateway")


def _assert_reads_only_pods_and_pools(config: TitoConfig, documents: list[dict[str, Any]], reader: str) -> None:
    """One namespaced Role, bound to the ServiceAccount only Deployment `reader` runs as, that
    may only get, list and watch pods and InferencePools (what discovery reads)."""
    assert not [d for d in documents if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    (role,) = [d for d in documents if d["kind"] == "Role"]
    (binding,) = [d for d in documents if d["kind"] == "RoleBinding"]
    granted = {
        (group, resource): sorted(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert granted == {
        ("", "pods"): ["get", "list", "watch"],
        ("inference.networking.k8s.io", "inferencepools"): ["get", "list", "watch"],
    }
    assert all(set(rule) == {"apiGroups", "resources", "verbs"} for rule in role["rules"])
    # namespaced, in the namespace every kubernetes discovery reads
    namespaces = {p.discovery.namespace for b in config.bases() for p in b.pools if p.discovery.source == "kubernetes"}
    assert namespaces == {role["metadata"]["namespace"]} == {binding["metadata"]["namespace"]}
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    pod = _object("Deployment", reader, documents)["spec"]["template"]["spec"]
    account = _object("ServiceAccount", pod["serviceAccountName"], documents)
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": account["metadata"]["namespace"]}
    ]
    assert pod.get("automountServiceAccountToken", True)  # the processor's in-cluster credentials
    # only the reader runs as it
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in documents if d["kind"] == "Deployment"}
    assert [name for name, spec in pods.items() if "serviceAccountName" in spec] == [reader]


def test_envoy_and_processor_share_the_endpoints_file(tmp_path: Path) -> None:
    config = _cluster_config(tmp_path)
    gateway = _object("Deployment", "tito-gateway")
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    folder = str(Path(config.listener.engine_endpoints_file).parent)

    def mount(container: dict[str, Any]) -> dict[str, Any]:
        (found,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
        return dict(found)

    envoy, processor = (mount(_container(gateway, name)) for name in ("envoy", "processor"))
    # the bootstrap writer leaves the first endpoints file there (Envoy refuses a missing one)
    writer = mount(_container(gateway, "envoy-config", init=True))
    # one emptyDir: the processor writes the engines there, Envoy watches them
    assert envoy["name"] == processor["name"] == writer["name"]
    assert volumes[envoy["name"]] == {"name": envoy["name"], "emptyDir": {}}
    assert not processor.get("readOnly", False) and not writer.get("readOnly", False)


def test_engines_are_scaled_deployments_behind_headless_services() -> None:
    for name, replicas in (("vllm-engine", 2), ("vllm-engine-b", 1)):
        deployment = _object("Deployment", name)
        assert deployment["spec"]["replicas"] == replicas  # `kubectl scale` changes it, nothing else
        # headless: the name resolves to every Ready pod (DNS discovery where the CRD is absent)
        service = _object("Service", name)
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
        assert _backend_port(service, "http") == _port(_container(deployment, "engine"), "http")
        # its readiness is what makes a pod Ready, i.e. a member of the pool (and a DNS record)
        assert _container(deployment, "engine")["readinessProbe"]["httpGet"]["path"] == "/health"


def test_engines_publish_what_the_processor_subscribes_to(tmp_path: Path) -> None:
    config = _cluster_config(tmp_path)
    engines = _object("Deployment", "vllm-engine")
    engine = _container(engines, "engine")
    assert "--enable-scale-out" in engine["args"]
    _assert_publishes_kv_events(engine["args"], config)
    # each discovered pod's publisher and replay ports are open on the engine container
    assert _kv_event_ports(config) <= {p["containerPort"] for p in engine["ports"]}
    render = _container(_object("Deployment", "tito-gateway"), "render")
    model_flags = [
        f"--model={config.model.path}",
        f"--served-model-name={config.model.served_name}",
        f"--max-model-len={config.model.max_model_len}",
    ]
    assert set(model_flags) <= set(engine["args"]) and set(model_flags) <= set(render["args"])
    assert "--disable-uvicorn-access-log" in render["args"]  # as `tito render` (render_config.access_log)
    # both pods generate the model everything loads (the gateway pod every base's)
    assert config.model.path == f"/models/tiny-qwen3-v{FORMAT_VERSION}"
    assert _container(engines, "model", init=True)["args"] == ["tiny-model", "--cache-dir", "/models"]
    generated = _container(_object("Deployment", "tito-gateway"), "model", init=True)["args"]
    assert generated == ["tiny-model", "--cache-dir", "/models", "--vocab-size", "1024", "768"]


def test_the_second_base_model_has_its_render_sidecar_and_engines(tmp_path: Path) -> None:
    (base,) = _cluster_config(tmp_path).models
    engines = _object("Deployment", "vllm-engine-b")
    engine = _container(engines, "engine")
    render = _container(_object("Deployment", "tito-gateway"), "render-b")
    assert f"--port={base.render_config.endpoint.port}" in render["args"]
    assert base.render_config.endpoint.host == "127.0.0.1"
    model_flags = [
        f"--model={base.model.path}",
        f"--served-model-name={base.model.served_name}",
        f"--max-model-len={base.model.max_model_len}",
    ]
    assert set(model_flags) <= set(engine["args"]) and set(model_flags) <= set(render["args"])
    assert base.model.path == f"/models/tiny-qwen3-v{FORMAT_VERSION}-vocab768"
    assert _container(engines, "model", init=True)["args"][-2:] == ["--vocab-size", "768"]


def test_mesh_filter_is_the_rendered_ext_proc_filter(tmp_path: Path) -> None:
    config = _cluster_config(tmp_path)
    patch = _mesh_patch()
    assert patch["applyTo"] == "HTTP_FILTER" and patch["patch"]["operation"] == "INSERT_BEFORE"
    assert patch["match"]["context"] == "GATEWAY"
    assert patch["match"]["listener"]["filterChain"]["filter"] == {
        "name": "envoy.filters.network.http_connection_manager",
        "subFilter": {"name": "envoy.filters.http.router"},
    }
    mesh = copy.deepcopy(patch["patch"]["value"])
    service = _object("Service", "tito-processor")
    (port,) = service["spec"]["ports"]
    # Istio's outbound cluster of the processor Service, which must speak gRPC to the processor
    cluster = (
        f"outbound|{port['port']}||{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    )
    assert mesh["typed_config"]["grpc_service"]["envoy_grpc"].pop("cluster_name") == cluster
    assert port["appProtocol"] == "grpc" and _backend_port(service) == config.processor.port
    (rendered,) = [f for f in _http_filters(yaml.safe_load(render_bootstrap(config))) if f["name"] == mesh["name"]]
    del rendered["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
    assert mesh == rendered


def test_the_mesh_gateway_keeps_a_refused_clients_connection_as_the_bootstrap_does(tmp_path: Path) -> None:
    patch = _mesh_patch("NETWORK_FILTER")
    assert patch["patch"]["operation"] == "MERGE" and patch["match"]["context"] == "GATEWAY"
    assert patch["match"]["listener"]["filterChain"]["filter"] == {
        "name": "envoy.filters.network.http_connection_manager"
    }
    merged = patch["patch"]["value"]["typed_config"]
    bootstrap = yaml.safe_load(render_bootstrap(_cluster_config(tmp_path)))
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert merged["@type"] == hcm["@type"]
    assert merged["http_protocol_options"] == hcm["http_protocol_options"]


def test_bootstrap_with_the_mesh_filter_passes_envoy_validate(tmp_path: Path, envoy_bin: Path) -> None:
    config = _cluster_config(tmp_path)
    config.listener.engine_endpoints_file = str(tmp_path / "run" / "engines.eds.json")  # the pod's folder is not here
    # written as the initContainer writes it: with the endpoints file Envoy starts from
    bootstrap = yaml.safe_load(write_bootstrap(config, tmp_path / "envoy.yaml").read_text())
    mesh = copy.deepcopy(_mesh_patch()["patch"]["value"])
    # Istio's outbound cluster does not exist outside the mesh: the bootstrap's processor cluster
    mesh["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = "ext_proc"
    assert "ext_proc" in {c["name"] for c in bootstrap["static_resources"]["clusters"]}
    filters = _http_filters(bootstrap)
    (index,) = [i for i, f in enumerate(filters) if f["name"] == mesh["name"]]
    filters[index] = mesh
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    result = _validate(envoy_bin, path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mesh_routes_the_rendered_paths_to_the_engine_service(tmp_path: Path) -> None:
    config = _cluster_config(tmp_path)
    envoy_filter = _object("EnvoyFilter", "tito-ext-proc")
    gateway, routes = _object("Gateway", "tito"), _object("VirtualService", "tito")
    assert envoy_filter["apiVersion"] == "networking.istio.io/v1alpha3"
    assert gateway["apiVersion"] == routes["apiVersion"] == "networking.istio.io/v1"
    # the filter is patched into the ingress gateway the Gateway binds (a workloadSelector
    # applies in the EnvoyFilter's own namespace: the ingress gateway's)
    assert envoy_filter["spec"]["workloadSelector"]["labels"] == gateway["spec"]["selector"]
    assert envoy_filter["metadata"]["namespace"] == "istio-system"
    (server,) = gateway["spec"]["servers"]
    assert server["port"]["protocol"] == "HTTP" and server["hosts"]
    assert routes["spec"]["gateways"] == [gateway["metadata"]["name"]]
    (route,) = routes["spec"]["http"]
    rendered = [r for r in config.listener.routes if r.handler not in ("passthrough", "health", "models")]
    exact = sorted(r.path for r in rendered if "{" not in r.path)
    assert sorted(m["uri"]["exact"] for m in route["match"] if "exact" in m["uri"]) == exact
    templated = {r.pattern for r in rendered if "{" in r.path}  # (answered by the processor at the gateway)
    assert {m["uri"]["regex"] for m in route["match"] if "regex" in m["uri"]} == templated
    engine = _object("Service", "vllm-engine")
    (port,) = [p for p in engine["spec"]["ports"] if p["name"] == "http"]
    # headless: at a gateway Istio's cluster for it is EDS of its Ready pods, the hosts an
    # override_host patch picks among; the processor finds the same pods itself (no IP list)
    assert engine["spec"]["clusterIP"] == "None"
    assert not [i for p in config.pools for i in p.instances] and config.pools[0].discovery.dynamic
    (destination,) = route["route"]
    assert destination["destination"] == {
        "host": f"{engine['metadata']['name']}.{engine['metadata']['namespace']}.svc.cluster.local",
        "port": {"number": port["port"]},
    }


# deploy/gie: tito as the endpoint picker of an InferencePool behind a GIE gateway


def _gie_config(tmp_path: Path) -> TitoConfig:
    path = tmp_path / "tito-epp.yaml"
    path.write_text(_object("ConfigMap", "tito-epp-config", _gie_documents())["data"]["tito.yaml"])
    return load_config(path, env={})


def test_gie_config_is_an_endpoint_picker_of_its_pool(tmp_path: Path) -> None:
    config = _gie_config(tmp_path)
    documents = _gie_documents()
    # reached through Service tito-epp and probed on the pod's IP: no loopback-only port
    assert config.processor.listen_host == "0.0.0.0"
    assert (config.processor.port, config.processor.admin_port) == (9002, 9003)
    # one address per pick: what a gateway routing with ORIGINAL_DST on the header parses
    assert config.processor.destination_endpoints == 1
    # one base model: the pool the route sends to, whose pods are its engines
    assert not config.models
    (pool,) = config.pools
    inference_pool = _object(INFERENCE_POOL[1], pool.discovery.inference_pool or "", documents)
    assert pool.discovery.source == "kubernetes" and not pool.instances
    assert pool.discovery.namespace == inference_pool["metadata"]["namespace"]
    assert [d["metadata"]["name"] for d in documents if d["kind"] == INFERENCE_POOL[1]] == [
        pool.discovery.inference_pool
    ]
    engines = _object("Deployment", inference_pool["metadata"]["name"], documents)
    engine = _container(engines, "engine")
    _assert_publishes_kv_events(engine["args"], config)
    assert _kv_event_ports(config) <= {p["containerPort"] for p in engine["ports"]}
    assert f"--served-model-name={config.model.served_name}" in engine["args"]


def test_gie_engines_and_namespace_are_the_base_ones() -> None:
    """Copies of deploy/kubernetes' objects (kustomize loads no file from outside its folder):
    they must not drift apart."""
    for kind, name in (("Namespace", "tito"), ("Deployment", "vllm-engine"), ("Service", "vllm-engine")):
        assert _object(kind, name, _gie_documents()) == _object(kind, name), f"{kind}/{name}"


def test_gie_inference_pool_names_the_epp_service(tmp_path: Path) -> None:
    config = _gie_config(tmp_path)
    documents = _gie_documents()
    inference_pool = _object(INFERENCE_POOL[1], "vllm-engine", documents)
    service = _assert_pool_is_the_deployments_pods(
        inference_pool, _object("Deployment", "vllm-engine", documents), documents
    )
    # written out, not left to defaults: tito-epp's gRPC port, failing closed
    assert inference_pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "tito-epp",
        "port": {"number": config.processor.port},
        "failureMode": "FailClose",
    }
    assert service["metadata"]["name"] == "tito-epp" and _selected(service, documents)["metadata"]["name"] == "tito-epp"
    # plaintext HTTP/2 (gRPC without TLS) to the processor's port
    (port,) = service["spec"]["ports"]
    assert (port["name"], port["port"], port["appProtocol"]) == ("grpc", config.processor.port, "kubernetes.io/h2c")
    assert _backend_port(service, "grpc", documents) == config.processor.port


@pytest.mark.parametrize("gateway", sorted(GIE_GATEWAYS))
def test_gie_route_sends_the_openai_paths_to_the_pool(tmp_path: Path, gateway: str) -> None:
    """The Gateway API objects (CRDs kubernetes-validate does not know) checked field by field
    as gateway.networking.k8s.io/v1 reads them."""
    config = _gie_config(tmp_path)
    documents = _gie_documents(gateway)
    route = _object("HTTPRoute", "tito", documents)
    assert route["apiVersion"] == GATEWAY_API and set(route["spec"]) == {"parentRefs", "rules"}
    # its Gateway: the one this gateway's folder adds, with its GatewayClass and a plain HTTP listener
    (parent,) = route["spec"]["parentRefs"]
    assert parent == {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway"}
    found = _object("Gateway", parent["name"], documents)
    assert found["apiVersion"] == GATEWAY_API
    assert found["metadata"]["namespace"] == route["metadata"]["namespace"]  # allowedRoutes default: Same
    assert found["spec"] == {
        "gatewayClassName": GIE_GATEWAYS[gateway],
        "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"}],
    }
    assert not [d for d in _gie_documents() if d["kind"] == "Gateway"]  # base/ leaves it to the gateway's folder
    (rule,) = route["spec"]["rules"]
    assert set(rule) == {"matches", "backendRefs", "timeouts"}
    # every path the processor renders is under the route's prefix
    (match,) = rule["matches"]
    assert match == {"path": {"type": "PathPrefix", "value": "/v1/"}}
    rendered = [r.path for r in config.listener.routes if r.handler not in ("passthrough", "health", "models")]
    assert rendered and all(path.startswith(match["path"]["value"]) for path in rendered)
    # the backend is the InferencePool (same namespace: no namespace field), not a Service
    (backend,) = rule["backendRefs"]
    assert backend == {"group": INFERENCE_POOL[0].split("/")[0], "kind": INFERENCE_POOL[1], "name": "vllm-engine"}
    pool = _object(INFERENCE_POOL[1], backend["name"], documents)
    assert pool["metadata"]["namespace"] == route["metadata"]["namespace"]
    # no overall deadline for SSE streams: the zero duration, in Gateway API's Duration format
    assert rule["timeouts"] == {"request": "0s"}
    assert re.fullmatch(r"([0-9]{1,5}(h|m|s|ms)){1,4}", rule["timeouts"]["request"])


def test_gie_epp_pod_is_the_processor_without_envoy(tmp_path: Path) -> None:
    config = _gie_config(tmp_path)
    documents = _gie_documents()
    epp = _object("Deployment", "tito-epp", documents)
    pod = epp["spec"]["template"]["spec"]
    # the gateway is the proxy: no Envoy and no bootstrap to write for one
    assert [c["name"] for c in pod["containers"]] == ["processor", "render"]
    assert [c["name"] for c in pod["initContainers"]] == ["model"]
    assert not [c for c in pod["containers"] + pod["initContainers"] if "envoy" in (c["name"] + c["image"])]
    processor, render = _container(epp, "processor"), _container(epp, "render")
    assert processor["args"] == ["--config", "/etc/tito/tito.yaml", "processor"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in processor["volumeMounts"] if m["mountPath"] == "/etc/tito"]
    assert volumes[mount["name"]]["configMap"]["name"] == "tito-epp-config"
    assert _port(processor, "grpc") == config.processor.port
    # the EPP protocol's health services, on the ext_proc port (the kubelet's gRPC probes)
    assert processor["livenessProbe"]["grpc"] == {"port": config.processor.port, "service": "liveness"}
    assert processor["readinessProbe"]["grpc"] == {"port": config.processor.port, "service": "readiness"}
    assert not {"httpGet", "tcpSocket", "exec"} & (set(processor["livenessProbe"]) | set(processor["readinessProbe"]))
    # until the tokenizer is loaded, the admin port's /health
    startup = processor["startupProbe"]["httpGet"]
    assert startup["path"] == "/health" and _port(processor, startup["port"]) == config.processor.admin_port
    assert _backend_port(_object("Service", "tito-epp-metrics", documents), documents=documents) == (
        config.processor.admin_port
    )
    # the render sidecar on loopback, and the model the engines serve
    assert config.render_config.endpoint.host == "127.0.0.1"
    assert f"--port={config.render_config.endpoint.port}" in render["args"]
    engines = _object("Deployment", "vllm-engine", documents)
    model_flags = [
        f"--model={config.model.path}",
        f"--served-model-name={config.model.served_name}",
        f"--max-model-len={config.model.max_model_len}",
    ]
    assert set(model_flags) <= set(_container(engines, "engine")["args"]) and set(model_flags) <= set(render["args"])
    assert config.model.path == f"/models/tiny-qwen3-v{FORMAT_VERSION}"
    assert _container(epp, "model", init=True)["args"] == _container(engines, "model", init=True)["args"]
    # open streams finish their drain before the kubelet kills the pod
    assert config.processor.drain_timeout_s < pod["terminationGracePeriodSeconds"]


def test_gie_role_grants_only_reading_pods_and_pools(tmp_path: Path) -> None:
    _assert_reads_only_pods_and_pools(_gie_config(tmp_path), _gie_documents(), "tito-epp")


def test_the_autoscaling_example_scales_the_engines_on_queued_tokens() -> None:
    (scaled,) = _documents(DEPLOY / "keda")
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    engine = _object("Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    assert engine["metadata"]["namespace"] == scaled["metadata"]["namespace"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["metadata"]["query"] == "sum(tito_flow_queued_tokens)"
    exposed = {m.name for m in _flow_gauges({"bands": {}, "tokens": 0, "oldest_wait_s": 0})}
    assert "tito_flow_queued_tokens" in exposed  # the metric the query reads exists
