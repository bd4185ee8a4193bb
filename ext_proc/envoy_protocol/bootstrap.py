"""Writes the Envoy bootstrap (envoy/envoy.yaml.j2) from the gateway config."""

from __future__ import annotations

import sys
from pathlib import Path

import jinja2

from ext_proc.config import TitoConfig

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
    return env.get_template(TEMPLATE).render(
        listener=config.listener,
        processor=config.processor,
        instances=[i for p in pools for i in p.instances],
        engine_requests=sum(p.max_requests_per_instance * len(p.instances) for p in pools),
        retries=config.scheduler.max_fallbacks,
        retry_budget_percent=config.scheduler.retry_budget_percent,
        tracing=config.tracing,
    )


def write_bootstrap(config: TitoConfig, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_bootstrap(config))
    return out
