"""Probing one engine or render endpoint for capability negotiation (`capabilities.py`
holds the records and decides with them): the HTTP requests and what their answers parse into.

Per engine (all GETs, two POSTs that cost the engine nothing, and one that costs a union engine a token once):
- `/version`; `/v1/models` (served names, `root`, `max_model_len`, LoRA adapters by `parent`);
- `/metrics`: `vllm:cache_config_info` (block size, prefix-caching hash algorithm);
- `/kv_event_sources` (where its KV events are published, where the engine serves it);
- `POST /inference/v1/generate` with `{}`: 400 is a live token-only route, 403 vLLM 0.32's
  answer without `--enable-scale-out`, 404 no such route (`TokenOnlyRoute`);
- `POST /tokenize` of a fixed canary chat: its own tokenizer's ids, compared with render's
  (made semantic first under token obfuscation: an engine on permuted weights answers physical ids).
- once per union engine while its record stands (`capabilities.fingerprint`): `POST
  /v1/completions` of one token for a few random ones, for the `system_fingerprint` native
  answers carry (vLLM's version and config hash; nothing else the engine serves shows it).
  Random, so that no prefix cache, local or a KV connector's, holds it: vLLM 0.32 behind a
  shared-storage connector dies on a prompt found whole in storage (seen on a decode engine).
Per render endpoint: `/version`, `/v1/models` and the same canary rendered. Between probes,
`GET /health` alone tells whether an engine is alive (`Prober.alive`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import replace
from typing import Any

import httpx
import orjson

from ext_proc.errors import GatewayError
from ext_proc.fleet.engine_metrics import CACHE_INFO, sample_labels
from ext_proc.frontend.render import Renderer, RenderRejected, RenderUnavailable, rendered
from ext_proc.obfuscation import TokenCodec
from ext_proc.protocol import GENERATE_PATH, OpenAIRequest, Pipeline
from scheduler.capabilities import EngineCapabilities, RenderCapabilities, token_only_route

# Marks the gateway's own probes (engine logs; the test simulator does not count them).
PROBE_HEADERS = {"user-agent": "tito-capabilities"}
# System text, a non-ASCII user turn: exercises the chat template, BOS/EOS handling and
# byte-level merges, so tokenizers or templates that differ give other ids.
CANARY_CHAT = [
    {"role": "system", "content": "You are a canary."},
    {"role": "user", "content": "héllo, 世界 ✓ <tag> 123"},
]


# -- parsing (pure) ------------------------------------------------------------------------


def parse_models(body: Any) -> dict[str, Any]:
    """`/v1/models`: the base model's names, root and context, and the LoRA adapters (entries
    with a `parent`). ValueError when it is not a model list."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        raise ValueError("no model list")
    bases = [m for m in data if not m.get("parent")]
    lens = [m["max_model_len"] for m in bases if isinstance(m.get("max_model_len"), int)]
    roots = [m["root"] for m in bases if isinstance(m.get("root"), str)]
    return {
        "served_models": tuple(m["id"] for m in bases),
        "root": roots[0] if roots else None,
        "max_model_len": min(lens) if lens else None,
        "lora_adapters": tuple(m["id"] for m in data if m.get("parent")),
        "model_cards": tuple(data),
    }


def parse_cache_config(text: str) -> dict[str, Any]:
    """`vllm:cache_config_info`'s labels: block size and prefix-caching hash (empty: absent)."""
    for line in text.splitlines():
        if line.startswith(CACHE_INFO + "{"):
            labels = sample_labels(line)
            size = labels.get("block_size", "")
            return {
                "block_size": int(size) if size.isdigit() else None,
                "hash_algo": labels.get("prefix_caching_hash_algo"),
            }
    return {}


def parse_kv_event_sources(body: Any) -> tuple[str, ...]:
    """`/kv_event_sources`: one publisher config per data-parallel rank (`{}`: none)."""
    if not isinstance(body, dict):
        return ()
    sources = body.values() if all(isinstance(v, dict) for v in body.values()) else [body]
    return tuple(str(s["endpoint"]) for s in sources if isinstance(s, dict) and s.get("endpoint"))


def parse_tokenized(body: Any) -> tuple[int, ...] | None:
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens):
        return tuple(tokens)
    return None


# -- probing (I/O) -------------------------------------------------------------------------


def failure_reason(exc: Exception) -> str:
    """Why a probe failed, as records and logs say it: `unreachable` when no answer came."""
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return f"unreachable: {what}" if isinstance(exc, httpx.TransportError) else f"probe failed: {what}"


class Prober:
    def __init__(
        self,
        http: httpx.AsyncClient,
        timeout_s: float,
        served_name: str,
        codec: TokenCodec | None = None,
        health_timeout_s: float = 1.0,
    ) -> None:
        self._http = http
        self._timeout_s = timeout_s
        self._health_timeout_s = health_timeout_s
        self._served_name = served_name
        self._codec = codec  # token obfuscation: an engine's own tokenizer answers in physical ids

    async def alive(self, address: str) -> str | None:
        """Why the engine is not alive (None: its server answers `GET /health` with anything
        but a 5xx; one without the route is up all the same). Raises httpx.TimeoutException
        when no answer came in time (httpx.PoolTimeout: this process's connections are all
        taken, which says nothing about the engine)."""
        url = f"http://{address}/health"
        try:
            response = await self._http.get(url, headers=PROBE_HEADERS, timeout=self._health_timeout_s)
        except httpx.TimeoutException:
            raise
        except httpx.HTTPError as exc:
            return failure_reason(exc)
        if response.status_code >= 500:
            return f"unhealthy: GET /health answered {response.status_code}"
        return None

    async def _get(self, url: str) -> httpx.Response:
        return await self._http.get(url, headers=PROBE_HEADERS, timeout=self._timeout_s)

    async def _post(self, url: str, body: dict[str, Any]) -> httpx.Response:
        content = orjson.dumps(body)
        headers = {**PROBE_HEADERS, "content-type": "application/json"}
        return await self._http.post(url, content=content, headers=headers, timeout=self._timeout_s)

    async def _json(self, url: str) -> Any:
        response = await self._get(url)
        return orjson.loads(response.content) if response.status_code == 200 else None

    async def _optional(self, fetch: Any) -> Any:
        """A part of the record an endpoint may lack (None: it did not answer it)."""
        try:
            return await fetch
        except (httpx.HTTPError, ValueError):
            return None

    async def engine(
        self, address: str, now: float, fingerprint: str | None = None, asks: bool = True
    ) -> EngineCapabilities:
        """One engine's record; httpx.HTTPError or ValueError when its model list is unreadable.
        `fingerprint`: its `system_fingerprint` as already known, else asked of it if `asks`."""
        base = f"http://{address}"
        models = parse_models(await self._json(base + "/v1/models"))
        probe = await self._post(base + GENERATE_PATH, {})
        version, metrics, sources, tokenized = await asyncio.gather(
            self._optional(self._json(base + "/version")),
            self._optional(self._get(base + "/metrics")),
            self._optional(self._json(base + "/kv_event_sources")),
            self._optional(self._post(base + "/tokenize", {"model": self._served_name, "messages": CANARY_CHAT})),
        )
        if fingerprint is None and asks:
            model = models["served_models"][0] if models["served_models"] else self._served_name
            fingerprint = await self._optional(self._fingerprint(base, model))
        cache = parse_cache_config(metrics.text) if metrics is not None and metrics.status_code == 200 else {}
        canary = None
        if tokenized is not None and tokenized.status_code == 200:
            canary = parse_tokenized(orjson.loads(tokenized.content))
        if canary is not None and self._codec is not None:
            # compared with render's semantic ids (an id outside the vocabulary: a mismatch)
            with contextlib.suppress(GatewayError):
                canary = tuple(self._codec.semantic_ids(canary))
        return EngineCapabilities(
            address,
            version=version.get("version") if isinstance(version, dict) else None,
            **models,
            **cache,
            kv_event_sources=parse_kv_event_sources(sources),
            token_only=token_only_route(probe.status_code),
            canary=canary,
            system_fingerprint=fingerprint,
            probed_at=now,
        )

    async def _fingerprint(self, base: str, model: str) -> str | None:
        """The `system_fingerprint` of the engine's native answers: one token generated for a
        few random ids (too short to fill a KV block: no prefix-cache entry, no KV event)."""
        prompt = random.sample(range(10, 256), 4)  # in any vocabulary (a byte-level one has 256)
        response = await self._post(base + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1})
        body = orjson.loads(response.content) if response.status_code == 200 else None
        value = body.get("system_fingerprint") if isinstance(body, dict) else None
        return value if isinstance(value, str) else None

    async def render(self, endpoint: str, url: str | None, renderer: Renderer, now: float) -> RenderCapabilities:
        """A render endpoint's record: what it renders the canary into, and (`url`: a render
        server; None: vLLM's renderer in this process) its version and models."""
        body = {"model": self._served_name, "messages": CANARY_CHAT}
        request = OpenAIRequest(Pipeline.CHAT, body)
        try:
            if url is None:
                tokenized = await renderer.render(request, orjson.dumps(body), "tito-canary")
            else:
                response = await self._post(url + request.endpoint + "/render", body)
                tokenized = rendered(request, response.status_code, response.content)
        except (RenderRejected, RenderUnavailable) as exc:
            raise ValueError(f"canary not rendered: {exc}") from exc
        record = RenderCapabilities(endpoint, canary=tuple(tokenized.prompts[0].token_ids), probed_at=now)
        if url is None:
            return replace(record, served_models=(self._served_name,))
        version = await self._optional(self._json(url + "/version"))
        models = await self._optional(self._json(url + "/v1/models"))
        parsed = parse_models(models) if models is not None else {}
        return replace(
            record,
            version=version.get("version") if isinstance(version, dict) else None,
            served_models=parsed.get("served_models", ()),
            max_model_len=parsed.get("max_model_len"),
        )
