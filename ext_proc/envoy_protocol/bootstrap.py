"""Writes the Envoy bootstrap (envoy/envoy.yaml.j2) from the gateway config."""

from __future__ import annotations

import sys
from pathlib import Path

import jinja2

from ext_proc.config import TitoConfig
from ext_proc.envoy_protocol.endpoints import EndpointsFile

TEMPLATE = "envoy.yaml.j2"
# The checkout's envoy/ (editable installs, tests), else where `pip install tito` put it.
_CHECKOUT = Path(__file__).resolve().parents[2] / "envoy"
TEMPLATE_DIR = _CHECKOUT if (_CHECKOUT / TEMPLATE).exists() else Path(sys.prefix) / "share" / "tito" / "envoy"


def render_bootstrap(config: TitoConfig) -> str:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    pools = [p for base in config.bases() for p in base.pools]  # every base model's engines
    sizes = [p.discovery.max_instances if p.discovery.dynamic else len(p.instances) for p in pools]
    endpoints = Path(config.listener.engine_endpoints_file)
    return env.get_template(TEMPLATE).render(
        listener=config.listener,
        processor=config.processor,
        instances=[i for p in pools for i in p.instances],
        # a discovered pool: the members come from the endpoints file the processor writes
        endpoints_file=str(endpoints) if discovered(config) else None,
        endpoints_dir=str(endpoints.parent),
        engine_requests=sum(p.max_requests_per_instance * n for p, n in zip(pools, sizes, strict=True)),
        engine_count=sum(sizes),
        retries=config.scheduler.max_fallbacks,
        retry_budget_percent=config.scheduler.retry_budget_percent,
        tracing=config.tracing,
    )


def discovered(config: TitoConfig) -> bool:
    """Whether any pool of any base model is discovered (Envoy then reads EDS from a file)."""
    return any(p.discovery.dynamic for base in config.bases() for p in base.pools)


def write_bootstrap(config: TitoConfig, out: Path) -> Path:
    """The bootstrap, and with a discovered pool the endpoints file Envoy starts from (the
    static members; the processor rewrites it as instances join and leave)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_bootstrap(config))
    if discovered(config):
        statics = [(i.host, i.port) for base in config.bases() for p in base.pools for i in p.instances]
        EndpointsFile(config.listener.engine_endpoints_file).write(statics)
    return out
