"""A request's flow from its headers (flow control, docs/flow-control.md): with API keys on,
its key's tenant (a missing, unknown or revoked key: 401; a model the tenant may not use:
403); else the fairness header's value (llm-d's `x-llm-d-inference-fairness-id`), or one
"default" flow. Its priority: the tenant's, else the objective the objective header names
(`admission.objectives`), else 0. Errors are OpenAI's; each API's room puts them in its own
envelope."""

from __future__ import annotations

from collections.abc import Mapping

from ext_proc.config import TitoConfig
from ext_proc.errors import GatewayError
from ext_proc.protocol import Flow
from ext_proc.tenancy.keys import ApiKeys, Tenant

NO_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using"
    " Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or in an x-api-key header."
)
BAD_KEY = "Incorrect API key provided."  # (never the key, not even masked: it could reach a log)
MAX_FLOW_NAME = 128  # a fairness header longer than this is cut (it becomes a label and a key)


def presented_key(headers: Mapping[str, str]) -> str | None:
    """`Authorization: Bearer <key>` (OpenAI) or `x-api-key: <key>` (Anthropic)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip() or None


class Tenancy:
    def __init__(self, config: TitoConfig) -> None:
        self._admission = config.admission
        keys_file = config.tenancy.keys_file
        self.keys = ApiKeys(keys_file, config.tenancy.reload_s) if keys_file is not None else None

    def flow(self, headers: Mapping[str, str]) -> Flow:
        """The request's flow; GatewayError 401 when keys are on and its key does not open."""
        if self.keys is None:
            name = headers.get(self._admission.fairness_header, "").strip()[:MAX_FLOW_NAME] or "default"
            return Flow(name=name, priority=self._objective(headers))
        key = presented_key(headers)
        if key is None:
            raise GatewayError(401, NO_KEY, kind="invalid_request_error")
        tenant = self.keys.tenant(key)
        if tenant is None:
            raise GatewayError(401, BAD_KEY, kind="invalid_request_error", code="invalid_api_key")
        return _tenant_flow(tenant)

    def _objective(self, headers: Mapping[str, str]) -> int:
        return self._admission.objectives.get(headers.get(self._admission.objective_header, ""), 0)

    @staticmethod
    def check_model(flow: Flow, model: object) -> None:
        """403 when the flow's tenant may not use the model the request names."""
        if flow.models and str(model) not in flow.models:
            raise GatewayError(403, f"Your API key may not use the model `{model}`.", code="model_not_allowed")


def _tenant_flow(tenant: Tenant) -> Flow:
    return Flow(
        name=tenant.name,
        priority=tenant.priority,
        weight=tenant.weight,
        tokens_per_minute=tenant.tokens_per_minute,
        tenant=tenant.name,
        models=tenant.models,
    )
