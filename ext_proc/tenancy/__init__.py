"""Tenants of a shared gateway: API keys, flows and token quotas (docs/flow-control.md)."""
