"""Capability records: what each engine and render endpoint serves, and what that decides.

Pure (no I/O): `ext_proc/fleet/capabilities.py` probes the endpoints and hands the records
here. A record is complete when the endpoint answered its model list and (engines) the
token-only probe; until then an engine does not route, nor while its last probe or liveness
check failed (`error`). `assess` compares a record with the config and with the tokenizer the
gateway renders with, and says whether the engine routes, whether it takes token-only
generate, and what differs.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


class TokenOnlyRoute(enum.Enum):
    """What `POST /inference/v1/generate` with an empty body answers."""

    LIVE = "live"  # 400: the route validates requests (vLLM --enable-scale-out or --tokens-only)
    DISABLED = "disabled"  # 403: vLLM 0.32 started without --enable-scale-out
    ABSENT = "absent"  # 404/405/501: no such route (older vLLM, another server)
    AUTH = "auth"  # 401: an API key is needed
    UNKNOWN = "unknown"  # not probed yet, or an answer none of the above


def token_only_route(status: int) -> TokenOnlyRoute:
    """The token-only probe's status as a verdict (anything but these tells nothing)."""
    if status in (400, 422):
        return TokenOnlyRoute.LIVE
    if status == 403:
        return TokenOnlyRoute.DISABLED
    if status in (404, 405, 501):
        return TokenOnlyRoute.ABSENT
    if status == 401:
        return TokenOnlyRoute.AUTH
    return TokenOnlyRoute.UNKNOWN


@dataclass(frozen=True)
class EngineCapabilities:
    """One engine's record, as of `probed_at` (the scheduler's clock). A failed probe or
    liveness check keeps the last good record's facts with `error` set (why it does not
    route until a probe passes again), never an empty one."""

    address: str
    version: str | None = None
    served_models: tuple[str, ...] = ()
    root: str | None = None
    max_model_len: int | None = None
    lora_adapters: tuple[str, ...] = ()
    # its /v1/models entries as listed (the gateway's own /v1/models merges them)
    model_cards: tuple[Mapping[str, Any], ...] = field(default=(), compare=False, repr=False)
    block_size: int | None = None  # vllm:cache_config_info (None: /metrics unreadable)
    hash_algo: str | None = None
    kv_event_sources: tuple[str, ...] = ()  # publisher endpoints from /kv_event_sources
    token_only: TokenOnlyRoute = TokenOnlyRoute.UNKNOWN
    canary: tuple[int, ...] | None = None  # its own tokenization of the canary (None: no /tokenize)
    # what its native answers carry as `system_fingerprint` (its version and config hash;
    # None: not known, e.g. a token-only engine without /v1/completions)
    system_fingerprint: str | None = None
    probed_at: float = 0.0
    error: str | None = None

    @property
    def complete(self) -> bool:
        return bool(self.served_models) and self.token_only is not TokenOnlyRoute.UNKNOWN


@dataclass(frozen=True)
class RenderCapabilities:
    """One render endpoint's record: what it renders the canary into."""

    endpoint: str
    version: str | None = None
    served_models: tuple[str, ...] = ()
    max_model_len: int | None = None
    canary: tuple[int, ...] | None = None
    probed_at: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class Expected:
    """What the config says an engine of a pool serves."""

    served_name: str
    max_model_len: int
    block_size: int
    hash_algo: str | None = None  # the KV-event hash the prefix index computes (None: not used)


@dataclass(frozen=True)
class Assessment:
    """What a record decides. `routes`: the engine takes requests. `token_only`: they are
    sent as token-only generate (else its native endpoint). `differences`: from the config,
    as `field engine-value (config config-value)`; `adopted`: the engine's value replaces the
    config's. `held_out`: why it does not route."""

    routes: bool
    token_only: bool
    differences: tuple[str, ...] = ()
    adopted: Mapping[str, int | str] = field(default_factory=dict)
    held_out: str | None = None


def assess(
    record: EngineCapabilities | None,
    expected: Expected,
    on_mismatch: str,
    reference: tuple[int, ...] | None,
    native_allowed: bool = True,
) -> Assessment:
    """The decision for one engine. `on_mismatch`: adopt | hold_out, for a block size, hash
    algorithm or max_model_len other than the config's; a tokenizer that disagrees with the
    `reference` canary always holds the engine out. `native_allowed` False (token
    obfuscation): an engine without token-only generate is held out, since its native
    endpoint would get plaintext."""
    if record is None or not record.complete:
        reason = record.error if record is not None and record.error else "not probed yet"
        return Assessment(False, False, held_out=f"no capability record: {reason}")
    token_only = record.token_only is TokenOnlyRoute.LIVE
    if record.error is not None:  # unreachable or unreadable since: the facts are kept, it does not route
        return Assessment(False, token_only, held_out=record.error)
    if not token_only and not native_allowed:
        reason = f"token-only generate {record.token_only.value}, and token obfuscation forbids its native endpoint"
        return Assessment(False, False, held_out=reason)
    if expected.served_name not in record.served_models:
        return Assessment(False, token_only, held_out=f"does not serve model {expected.served_name!r}")
    if record.canary is not None and reference is not None and record.canary != reference:
        return Assessment(False, token_only, ("tokenizer",), held_out="tokenizer mismatch: canary ids differ")
    found = {
        "max_model_len": (record.max_model_len, expected.max_model_len),
        "block_size": (record.block_size, expected.block_size),
        "hash_algo": (record.hash_algo, expected.hash_algo),
    }
    differ = {name: pair for name, pair in found.items() if pair[0] is not None and pair[1] is not None}
    differ = {name: pair for name, pair in differ.items() if pair[0] != pair[1]}
    differences = tuple(f"{name} {mine} (config {theirs})" for name, (mine, theirs) in differ.items())
    if differ and on_mismatch == "hold_out":
        return Assessment(False, token_only, differences, held_out="differs from config: " + ", ".join(differences))
    adopted = {name: mine for name, (mine, _) in differ.items() if mine is not None}
    return Assessment(True, token_only, differences, adopted)


def canary_reference(
    render: Mapping[str, tuple[int, ...] | None], engines: Iterable[tuple[int, ...] | None]
) -> tuple[int, ...] | None:
    """The canary ids the gateway's tokenization should give: the ones most endpoints agree
    on, render endpoints and engines alike; a tie goes to the render endpoints' answer
    (the first configured). None: nobody rendered or tokenized it yet."""
    votes: Counter[tuple[int, ...]] = Counter()
    first_seen: list[tuple[int, ...]] = []
    for ids in [*render.values(), *engines]:
        if ids is not None:
            votes[ids] += 1
            if ids not in first_seen:
                first_seen.append(ids)
    if not votes:
        return None
    best = max(votes.values())
    return next(ids for ids in first_seen if votes[ids] == best)


def unready_pools(pools: Mapping[str, Mapping[str, str | None]]) -> dict[str, str]:
    """The pools none of whose engines routes, each with why, engine by engine (`pools`:
    pool -> engine -> why it is held out, None when it routes). The gateway is ready when
    there are none: a gateway that cannot place a request must not take one."""
    return {
        pool: "no engine routes (" + "; ".join(f"{address} {why}" for address, why in engines.items()) + ")"
        if engines
        else "no engine found (a discovered pool with no instance)"
        for pool, engines in pools.items()
        if all(why is not None for why in engines.values())
    }
