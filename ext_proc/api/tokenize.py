"""vLLM's `POST /tokenize` and `POST /detokenize`, answered by render alone: no engine ever
sees them. Opt-in: a route whose handler is `tokenize` or `detokenize` in `listener.routes`
(the default table has none, so Envoy answers those paths 404 as before).

Render serves both routes itself (`vllm launch render` mounts vLLM's tokenize router and
builds a `ServingTokenization` over the same renderer), so its answer *is* native's: the
body goes to a render endpoint's route as the client sent it (named after the base model, as
every render call is) and its status and body come back unchanged, errors included. What
native answers before the route (a body that is not JSON, the wrong content type, an unknown
model) the gateway answers already (`api/body.py`, `Services.plan`).

Endpoints are the render pool's, picked and judged as a render is (`RenderPool.answer`): a
closed breaker first, one more endpoint when the first fails (connect error, timeout, 5xx,
429), an endpoint that fails opens its breaker. There is no local fallback: when no endpoint
answers, a 503 `render_unavailable`. With render in process, vLLM's `ServingTokenization` is
built beside the loaded `ServingRender` and called as its route calls it (`in_process_routes`,
served by `InProcessRender`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from ext_proc.errors import GatewayError
from ext_proc.frontend.render import Renderer, RenderUnavailable
from ext_proc.frontend.render_in_process import RenderRoute
from ext_proc.frontend.render_pool import RenderPool
from ext_proc.planning.plan import Local, Plan

log = logging.getLogger("tito.tokenize")

PATHS = {"tokenize": "/tokenize", "detokenize": "/detokenize"}  # handler -> render's (and native's) route


class TokenizeApi:
    """`/tokenize` and `/detokenize` for one base model (`api.routes.ClientApi`), through the
    render pool's endpoints; `renderer` None: render is disabled (every request a 503)."""

    handlers = tuple(PATHS)
    generating = ()

    def __init__(self, renderer: Renderer | None, served_name: str) -> None:
        self._pool = renderer if isinstance(renderer, RenderPool) else None
        self._served_name = served_name

    def error(self, status: int, body: bytes) -> bytes:
        return body  # native's tokenize errors are OpenAI's

    async def refused(self, handler: str, body: dict[str, Any], raw: bytes, request_id: str) -> Local | None:
        return None  # (render's tokenize routes look the model up first)

    async def plan(self, handler: str, body: dict[str, Any], raw: bytes, request_id: str) -> Plan:
        path = PATHS[handler]
        if self._pool is None:
            return Local(*unavailable("render is disabled (render_config.enable: false)"))
        try:
            return Local(*await self._pool.answer(path, named_after_base(body, raw, self._served_name), request_id))
        except RenderUnavailable as exc:
            log.warning("no render endpoint answered %s for %s (%s)", path, request_id, exc)
            return Local(*unavailable(f"no render endpoint answered {path} ({exc})"))


def named_after_base(body: dict[str, Any], raw: bytes, served_name: str) -> bytes:
    """The body render gets: named after the base model, as `Planner._as_base` names every
    body render gets (render serves no alias and no adapter; both tokenize as the base)."""
    if body.get("model", served_name) == served_name:
        return raw
    return orjson.dumps({**body, "model": served_name})


def unavailable(message: str) -> tuple[int, bytes]:
    """The 503 a request gets when render cannot answer it (no engine can: it never goes there)."""
    return 503, GatewayError(503, message, code="render_unavailable").body


# -- render in process: vLLM's tokenize routes beside its render routes


def in_process_routes() -> dict[str, RenderRoute]:
    """vLLM's `/tokenize` and `/detokenize` routes (`serve/tokenize/api_router.py`): the body
    validated with the route's request model, then `ServingTokenization`'s call."""
    return {
        "/tokenize": RenderRoute(_tokenize_model, _served("create_tokenize")),
        "/detokenize": RenderRoute(_detokenize_model, _served("create_detokenize")),
    }


def _served(method: str) -> Callable[[Any, Any, Any], Awaitable[Any]]:
    """`ServingTokenization.<method>` on the validated body, as the route calls it."""

    async def call(serving: Any, parsed: Any, caller: Any) -> Any:
        return await getattr(_tokenization(serving), method)(parsed, caller)

    return call


@functools.cache
def _tokenize_model() -> Any:
    """`TokenizeRequest` is a union (completions or chat form): validated as FastAPI validates
    the route's body, with a `TypeAdapter`."""
    from pydantic import TypeAdapter
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeRequest

    return TypeAdapter(TokenizeRequest)


@functools.cache
def _detokenize_model() -> Any:
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

    return DetokenizeRequest


@functools.cache
def _tokenization(serving: Any) -> Any:
    """vLLM's `ServingTokenization` as `init_render_app_state` builds it beside `serving` (the
    render server's `ServingRender`): the same model registry, renderer and chat-template
    settings, which the renderer keeps."""
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization

    online = serving.online_renderer
    return ServingTokenization(
        serving.models,
        online,
        request_logger=serving.request_logger,
        chat_template=online.chat_template,
        chat_template_content_format=online.chat_template_content_format,
        default_chat_template_kwargs=online.default_chat_template_kwargs,
        trust_request_chat_template=online.trust_request_chat_template,
    )
