"""`/ready`'s engines check: with every breaker open it follows panic routing (the gateway
still routes, so it is ready); without panic routing it is not ready until a cool-down ends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ext_proc.admin import _engines_ready
from ext_proc.config import TitoConfig
from ext_proc.server import build_scheduler


@pytest.mark.parametrize(("panic", "ready_while_open"), [(True, True), (False, False)])
def test_engines_ready_with_every_breaker_open(panic: bool, ready_while_open: bool) -> None:
    config = TitoConfig.model_validate(
        {
            "pools": [{"name": "union", "role": "union", "instances": [{"port": 8200}]}],
            "scheduler": {"breaker": {"failure_threshold": 1, "base_cooldown_s": 5.0, "panic_when_all_open": panic}},
        }
    )
    scheduler = build_scheduler(config)
    services = SimpleNamespace(config=config, scheduler=scheduler)
    assert _engines_ready(services, 0.0)  # type: ignore[arg-type]
    scheduler.breakers["127.0.0.1:8200"].record_failure(10.0)
    assert _engines_ready(services, 11.0) is ready_while_open  # type: ignore[arg-type]
    assert _engines_ready(services, 15.0)  # type: ignore[arg-type]  # cool-down over: the next request probes


def test_an_empty_pool_is_not_ready_even_with_panic_routing() -> None:
    config = TitoConfig.model_validate({"pools": [{"name": "union", "role": "union", "instances": [{"port": 8200}]}]})
    scheduler = build_scheduler(config)
    scheduler.leave("127.0.0.1:8200")
    assert not _engines_ready(SimpleNamespace(config=config, scheduler=scheduler), 0.0)  # type: ignore[arg-type]
