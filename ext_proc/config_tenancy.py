"""The config of a shared gateway's tenants and flows: API keys and per-tenant token quotas
(`tenancy`), and the queue in front of admission with its priority bands and fair share
(`admission.queue_*`, `admission.objectives`, in config_routing.py). Off by default: with no
keys file every request is one anonymous tenant, and with no queue timeout a request that
does not fit is refused at once (429), as before flow control existed."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ext_proc.config_section import Section


class TenancyConfig(Section):
    """API keys (`Authorization: Bearer`, Anthropic's `x-api-key`), each a tenant with a
    priority, a weight, allowed models and token quotas (docs/flow-control.md)."""

    # YAML of tenants and their keys, stored as SHA-256 hashes (`tito hash-key` prints one);
    # a mounted Kubernetes Secret works as is. None: no keys, one anonymous tenant.
    keys_file: str | None = None
    # The file is read again when it changes (a revoked key stops working within this).
    reload_s: float = Field(default=2.0, gt=0)
    # Tokens-per-minute quotas shared by every processor worker and replica through Redis
    # (redis://host:port/db). None: each process enforces its equal share on its own.
    redis_url: str | None = None
    # Redis unreachable: `local` falls back to each process's share; `refuse` answers 503.
    redis_fail_mode: Literal["local", "refuse"] = "local"
    redis_timeout_s: float = Field(default=0.25, gt=0)  # per quota call; past it, the fail mode
