"""vLLM's `POST /tokenize` and `POST /detokenize`, answered by render alone: no engine ever
sees them. Opt-in: a route whose handler is `tokenize` or `detokenize` in `listener.routes`
(the default table has none, so Envoy answers those paths 404 as before).

Render serves both routes itself (`vllm launch render` mounts vLLM's tokenize router and
builds a `ServingTokenization` over the same renderer), so its answer *is* native's: the
body goes to a render endpoint's route as the client sent it (named after the base model, as
every render call is) and its status and body come back unchanged, errors included. What
native answers before the route (a body that is not JSON, the wrong content type, an unknown
model) the gateway answers already (`api/body.py`, `Services.plan`).

Endpoints are the render pool's, picked and judged as a render is (`frontend/render_pool.py`):
a closed breaker first, one more endpoint when the first fails (connect error, timeout, 5xx,
429), an endpoint that fails opens its breaker. There is no local fallback: when no endpoint
answers, a 503 `render_unavailable`. An endpoint that does not serve the route (an older
render server: 404 without an OpenAI error) is no verdict on its rendering: its breaker is
left alone. With render in process, vLLM's `ServingTokenization` is built beside the loaded
`ServingRender` and called as its route calls it (`InProcessRender` serves these paths)."""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import orjson

from ext_proc.errors import GatewayError
from ext_proc.frontend.render import UNSUPPORTED_STATUSES, Renderer, RenderUnavailable
from ext_proc.frontend.render_in_process import InProcessRender, RenderRoute
from ext_proc.frontend.render_pool import RETRIABLE, RenderMember, RenderPool
from ext_proc.planning.plan import Local, Plan
from scheduler import BreakerState

log = logging.getLogger("tito.tokenize")

PATHS = {"tokenize": "/tokenize", "detokenize": "/detokenize"}  # handler -> render's (and native's) route
ATTEMPTS = 2  # as a render: the endpoint picked, then one more
TIMEOUT_S = 5.0  # per attempt: `render_config.timeout_ms`'s default


class TokenizeApi:
    """`/tokenize` and `/detokenize` for one base model (`api.routes.ClientApi`), through the
    render pool's endpoints; `renderer` None: render is disabled (every request a 503)."""

    handlers = tuple(PATHS)

    def __init__(
        self,
        renderer: Renderer | None,
        served_name: str,
        http: httpx.AsyncClient | None = None,
        timeout_s: float = TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = renderer if isinstance(renderer, RenderPool) else None
        self._served_name = served_name
        self._http = http  # None: one of its own, made on the first sidecar call
        self._timeout_s = timeout_s
        self._clock = clock
        self._turn = 0  # rotates which closed endpoint goes first
        if self._pool is not None:
            serve_in_process(self._pool)

    def error(self, status: int, body: bytes) -> bytes:
        return body  # native's tokenize errors are OpenAI's

    async def plan(self, handler: str, body: dict[str, Any], raw: bytes, request_id: str) -> Plan:
        raw = named_after_base(body, raw, self._served_name)
        return Local(*await self.answer(PATHS[handler], raw, request_id))

    async def answer(self, path: str, raw: bytes, request_id: str) -> tuple[int, bytes]:
        """Render's own status and body for `raw` on `path`, or a 503 when no endpoint answers."""
        if self._pool is None:
            return unavailable("render is disabled (render_config.enable: false)")
        failure: RenderUnavailable | None = None
        for member in self._members():
            try:
                return await self._attempt(member, path, raw, request_id)
            except RenderUnavailable as exc:
                log.warning("render endpoint %s failed %s for %s (%s)", member.name, path, request_id, exc)
                failure = exc
                if exc.reason not in RETRIABLE:
                    break
        return unavailable(f"no render endpoint answered {path}" + (f" ({failure})" if failure else ""))

    def _members(self) -> Iterator[RenderMember]:
        """At most ATTEMPTS endpoints: closed ones, least busy first (ties take turns), then
        one whose cool-down ended (its half-open probe). Lazy: a failed endpoint's breaker is
        already open when the next one is chosen."""
        assert self._pool is not None
        usable = [m for m in self._pool.members if not m.held_out]
        start, self._turn = self._turn % max(len(usable), 1), self._turn + 1
        rotated = usable[start:] + usable[:start]
        closed = sorted((m for m in rotated if m.breaker.state is BreakerState.CLOSED), key=lambda m: m.in_flight)
        probing = (m for m in rotated if m not in closed and m.breaker.allows(self._clock()))
        return itertools.islice(itertools.chain(closed, probing), ATTEMPTS)

    async def _attempt(self, member: RenderMember, path: str, raw: bytes, request_id: str) -> tuple[int, bytes]:
        """One endpoint's answer, its breaker told how it went (as a render's attempt)."""
        member.breaker.on_dispatch()
        member.in_flight += 1
        try:
            status, body = await self._call(member, path, raw, request_id)
            endpoint_fault(path, status, body)
        except RenderUnavailable as exc:
            if exc.reason == "unsupported":  # it may render well: no verdict on the endpoint
                member.breaker.record_abandoned()
            else:
                member.breaker.record_failure(self._clock())
            raise
        except BaseException:  # cancelled (the client left): no verdict either
            member.breaker.record_abandoned()
            raise
        finally:
            member.in_flight -= 1
        member.breaker.record_success()
        return status, body

    async def _call(self, member: RenderMember, path: str, raw: bytes, request_id: str) -> tuple[int, bytes]:
        if isinstance(member.renderer, InProcessRender):
            # (status, body) as the sidecar's route answers (what the render parity test compares)
            return await member.renderer._answer(path, raw, request_id)
        assert member.url is not None
        if self._http is None:
            self._http = httpx.AsyncClient(trust_env=False)
        headers = {"content-type": "application/json", "x-request-id": request_id}
        try:
            response = await self._http.post(member.url + path, content=raw, headers=headers, timeout=self._timeout_s)
        except httpx.TimeoutException as exc:
            raise RenderUnavailable("timeout", repr(exc)) from exc
        except httpx.HTTPError as exc:
            raise RenderUnavailable("unavailable", repr(exc)) from exc
        return response.status_code, response.content


def named_after_base(body: dict[str, Any], raw: bytes, served_name: str) -> bytes:
    """The body render gets: named after the base model, as `Planner._as_base` names every
    body render gets (render serves no alias and no adapter; both tokenize as the base)."""
    if body.get("model", served_name) == served_name:
        return raw
    return orjson.dumps({**body, "model": served_name})


def endpoint_fault(path: str, status: int, body: bytes) -> None:
    """Nothing when `status` and `body` are the route's own answer (passed on unchanged);
    else `RenderUnavailable`: the endpoint does not serve `path`, or failed."""
    error = _openai_error(body)
    if status in UNSUPPORTED_STATUSES and not error:  # as `render.rendered` judges: no such route there
        raise RenderUnavailable("unsupported", f"HTTP {status} on {path}")
    if status == 429 or (status >= 500 and not (status == 501 and error)):
        raise RenderUnavailable("unavailable", f"HTTP {status} on {path}")
    if status == 200 and not _json_object(body):
        raise RenderUnavailable("invalid_response", f"render answered {path} with no JSON object")


def unavailable(message: str) -> tuple[int, bytes]:
    """The 503 a request gets when render cannot answer it (no engine can: it never goes there)."""
    return 503, GatewayError(503, message, code="render_unavailable").body


def _json_object(body: bytes) -> bool:
    try:
        return isinstance(orjson.loads(body), dict)
    except orjson.JSONDecodeError:
        return False


def _openai_error(body: bytes) -> bool:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)


# -- render in process: vLLM's tokenize routes beside its render routes


def serve_in_process(pool: RenderPool) -> None:
    """The pool's in-process renderer answers these paths as the sidecar's routes do."""
    for member in pool.members:
        if isinstance(member.renderer, InProcessRender):
            for path, route in in_process_routes().items():
                member.renderer.serve(path, route)


def in_process_routes() -> dict[str, RenderRoute]:
    """vLLM's `/tokenize` and `/detokenize` routes (`serve/tokenize/api_router.py`): the body
    validated with the route's request model, then `ServingTokenization`'s call."""
    return {
        "/tokenize": RenderRoute(_tokenize_model, _served("create_tokenize")),
        "/detokenize": RenderRoute(_detokenize_model, _served("create_detokenize")),
    }


class _Validated:
    """A route's request model as FastAPI applies it (`model_validate`, as `RenderRoute` calls it)."""

    def __init__(self, validate: Callable[[Any], Any]) -> None:
        self.model_validate = validate


def _served(method: str) -> Callable[[Any, Any, Any], Awaitable[Any]]:
    """`ServingTokenization.<method>` on the validated body, as the route calls it."""

    async def call(serving: Any, parsed: Any, caller: Any) -> Any:
        return await getattr(_tokenization(serving), method)(parsed, caller)

    return call


@functools.cache
def _tokenize_model() -> _Validated:
    """`TokenizeRequest` is a union (completions or chat form): validated as FastAPI validates
    the route's body, with a `TypeAdapter`."""
    from pydantic import TypeAdapter
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeRequest

    return _Validated(TypeAdapter(TokenizeRequest).validate_python)


@functools.cache
def _detokenize_model() -> _Validated:
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

    return _Validated(DetokenizeRequest.model_validate)


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
