"""Tenants: API keys stored hashed and compared in constant time, a revoked key refused once
the file changes, flows from keys or headers, and the errors in each API's envelope."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import orjson
import pytest

from ext_proc.config import TitoConfig
from ext_proc.errors import GatewayError
from ext_proc.protocol import Flow
from ext_proc.tenancy.flows import Tenancy, presented_key
from ext_proc.tenancy.keys import ApiKeys, hash_key, parse_keys

KEY_A, KEY_B = "sk-team-a-0123456789", "sk-team-b-9876543210"


def _keys_file(path: Path, *tenants: dict[str, Any]) -> Path:
    lines = ["tenants:"]
    for tenant in tenants:
        lines.append(f"- name: {tenant['name']}")
        for field in ("priority", "weight", "tokens_per_minute"):
            if field in tenant:
                lines.append(f"  {field}: {tenant[field]}")
        if "models" in tenant:
            lines.append(f"  models: {list(tenant['models'])}")
        lines.append(f"  keys: {[hash_key(k) for k in tenant['keys']]}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_keys_are_stored_hashed_and_a_plain_key_in_the_file_is_refused() -> None:
    assert hash_key(KEY_A).startswith("sha256:") and KEY_A not in hash_key(KEY_A)
    with pytest.raises(ValueError, match="hashed"):
        parse_keys(f"tenants:\n- name: a\n  keys: [{KEY_A}]\n")


def test_a_key_opens_its_tenant_and_a_revoked_one_nothing(tmp_path: Path) -> None:
    path = _keys_file(
        tmp_path / "keys.yaml", {"name": "a", "priority": 2, "keys": [KEY_A]}, {"name": "b", "keys": [KEY_B]}
    )
    keys = ApiKeys(str(path), reload_s=1)
    tenant = keys.tenant(KEY_A)
    assert tenant is not None and tenant.name == "a" and tenant.priority == 2
    assert keys.tenant("sk-unknown") is None
    _keys_file(path, {"name": "b", "keys": [KEY_B]}, {"name": "c", "weight": 3, "keys": ["sk-c-000000000000000000"]})
    keys.load()  # (the poller's step)
    assert keys.tenant(KEY_A) is None and keys.tenant(KEY_B) is not None


def test_a_broken_file_keeps_the_keys_and_no_key_reaches_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    path = _keys_file(tmp_path / "keys.yaml", {"name": "a", "keys": [KEY_A]})
    keys = ApiKeys(str(path), reload_s=1)
    path.write_text("tenants: [{name: a, keys: [" + KEY_B + "]}]\n")  # a plain key: refused, logged by kind only
    keys.load()
    assert keys.tenant(KEY_A) is not None
    assert KEY_A not in caplog.text and KEY_B not in caplog.text and hash_key(KEY_A) not in caplog.text


def test_the_key_comes_from_bearer_or_x_api_key() -> None:
    assert presented_key({"authorization": f"Bearer {KEY_A}"}) == KEY_A
    assert presented_key({"x-api-key": KEY_B}) == KEY_B
    assert presented_key({"authorization": "Basic abc"}) is None and presented_key({}) is None


def _tenancy(tmp_path: Path, **admission: Any) -> Tenancy:
    return Tenancy(TitoConfig.model_validate({"admission": admission}))


def test_without_keys_flows_come_from_the_fairness_and_objective_headers(tmp_path: Path) -> None:
    tenancy = _tenancy(tmp_path, objectives={"batch": -1, "chat": 5})
    assert tenancy.flow({}) == Flow()
    flow = tenancy.flow({"x-llm-d-inference-fairness-id": "team-x", "x-llm-d-inference-objective": "batch"})
    assert flow == Flow(name="team-x", priority=-1)
    assert tenancy.flow({"x-llm-d-inference-objective": "unknown"}).priority == 0


def test_with_keys_a_missing_or_unknown_key_is_401_and_models_are_checked(tmp_path: Path) -> None:
    path = _keys_file(tmp_path / "k.yaml", {"name": "a", "models": ["tiny"], "tokens_per_minute": 900, "keys": [KEY_A]})
    tenancy = Tenancy(TitoConfig.model_validate({"tenancy": {"keys_file": str(path)}}))
    flow = tenancy.flow({"authorization": f"Bearer {KEY_A}", "x-llm-d-inference-fairness-id": "spoofed"})
    assert (flow.name, flow.tenant, flow.tokens_per_minute) == ("a", "a", 900)  # the key decides, not a header
    for headers, code in (({}, None), ({"x-api-key": "sk-nope"}, "invalid_api_key")):
        with pytest.raises(GatewayError) as refused:
            tenancy.flow(headers)
        error = orjson.loads(refused.value.body)["error"]
        assert refused.value.status == 401 and error["type"] == "invalid_request_error" and error["code"] == code
    Tenancy.check_model(flow, "tiny")
    with pytest.raises(GatewayError) as forbidden:
        Tenancy.check_model(flow, "other")
    assert forbidden.value.status == 403
