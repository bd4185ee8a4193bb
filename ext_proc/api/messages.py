"""Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`) over the chat pipeline,
as native vLLM serves it.

Native vLLM's `/v1/messages` is its chat pipeline between two converters: the Messages request
becomes a chat request (`AnthropicServingMessages.to_chat_completion_request`), and the chat
answer becomes a Messages answer (`messages_full_converter`, `message_stream_converter`). The
gateway does the same with vLLM's own converters, so everything between them is chat: render,
admission, scheduling, P/D, relay, obfuscation and derender see a chat request.

What native decides per model, the gateway decides the same way, once per base model, by
rendering through the render pool (`MessagesFrontend.settings`):
- `merge_inline_system`: native checks whether the chat template refuses a system message
  after the first turn; here a render of such a conversation answers it;
- the reasoning effort `thinking: {type: disabled}` maps to: "none", unless rendering with
  "none" fails or renders as some effort does ("low"), native's probe.

Errors: a body vLLM's request model refuses gets native's validation error (OpenAI envelope,
as FastAPI's handler answers it before the route); everything the route answers is in
Anthropic's envelope `{"type": "error", "error": {"type", "message"}}`, with the same status.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson
from pydantic import ValidationError

from ext_proc.api.body import refused_by, validation_error
from ext_proc.api.stepped import Stepped
from ext_proc.errors import GatewayError
from ext_proc.extras import PROCESSOR, require
from ext_proc.frontend.render import Renderer, RenderUnavailable
from ext_proc.frontend.render_in_process import as_fastapi_validates
from ext_proc.planning.plan import Local, Plan
from ext_proc.planning.planner import Planner
from ext_proc.protocol import OpenAIRequest, Pipeline

log = logging.getLogger("tito.messages")

# The probe native renders to find what a disabled thinking maps to, and the conversation a
# template that wants the system prompt first refuses (native: `_detect_merge_inline_system`).
_PROBE_MESSAGES = [{"role": "user", "content": "Hi"}]
_INLINE_SYSTEM = [
    {"role": "system", "content": "t"},
    {"role": "user", "content": "t"},
    {"role": "system", "content": "t"},
    {"role": "user", "content": "t"},
]


@dataclass(frozen=True)
class MessagesSettings:
    merge_inline_system: bool
    disabled_thinking_effort: str


DEFAULTS = MessagesSettings(merge_inline_system=False, disabled_thinking_effort="none")  # native's own


class MessagesFrontend:
    """One base model's Messages front: request conversion with that model's settings."""

    def __init__(self, renderer: Renderer | None, served_name: str) -> None:
        self._renderer = renderer  # None: render disabled (native's defaults then)
        self._served_name = served_name
        self._settings: MessagesSettings | None = None
        self._lock = asyncio.Lock()

    async def chat_body(self, body: dict[str, Any], count_tokens: bool = False) -> dict[str, Any]:
        """The chat request native serving makes of this Messages request (a GatewayError with
        native's status and body when it refuses it)."""
        require("the Messages API (vLLM's converters)", PROCESSOR, "vllm")
        from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

        model = AnthropicCountTokensRequest if count_tokens else AnthropicMessagesRequest
        try:
            request = as_fastapi_validates(model, body)
        except ValidationError as exc:
            raise GatewayError(400, "invalid request", body=await validation_error(exc)) from exc
        settings = await self.settings()
        thinking = getattr(request, "thinking", None)
        disabled = thinking is not None and thinking.type == "disabled"
        try:
            chat = AnthropicServingMessages.to_chat_completion_request(
                request,
                merge_inline_system=settings.merge_inline_system,
                disabled_thinking_effort=settings.disabled_thinking_effort if disabled else "none",  # type: ignore[arg-type]
            )
        except Exception as exc:  # the route's own refusal (e.g. a tool change naming no tool)
            raise GatewayError(400, str(exc), body=route_error(exc)) from exc
        dumped: dict[str, Any] = chat.model_dump(mode="json", exclude_unset=True, by_alias=True)
        dumped.pop("request_id", None)  # the gateway's own id names the answer
        return dumped

    async def settings(self) -> MessagesSettings:
        """Probed once per base model, on the first Messages request. While render cannot
        answer (every endpoint down), native's defaults serve and the probe waits for the next
        request: the request itself then goes the way a chat request goes without render."""
        if self._settings is None:
            async with self._lock:
                if self._settings is None:
                    try:
                        self._settings = await self._probe()
                    except _Undecided as exc:
                        log.warning("messages settings for %s not probed yet: %s", self._served_name, exc)
                        return DEFAULTS
                    log.info("messages settings for %s: %s", self._served_name, self._settings)
        return self._settings

    async def _probe(self) -> MessagesSettings:
        from typing import get_args

        from vllm.entrypoints.anthropic.protocol import AnthropicEffort

        if self._renderer is None:
            return DEFAULTS
        merge = await self._rendered({"messages": _INLINE_SYSTEM}) is None
        none = await self._rendered({"messages": _PROBE_MESSAGES, "reasoning_effort": "none"})
        effort = "none"
        if none is None:
            effort = "low"
        else:
            for other in get_args(AnthropicEffort):
                if await self._rendered({"messages": _PROBE_MESSAGES, "reasoning_effort": other}) == none:
                    effort = "low"
                    break
        return MessagesSettings(merge_inline_system=merge, disabled_thinking_effort=effort)

    async def _rendered(self, fields: dict[str, Any]) -> list[int] | None:
        """The ids render gives for a chat probe; None when render refuses it."""
        assert self._renderer is not None
        body = {"model": self._served_name, **fields}
        try:
            tokenized = await self._renderer.render(
                OpenAIRequest(Pipeline.CHAT, body), orjson.dumps(body), "tito-messages-probe"
            )
        except RenderUnavailable as exc:
            raise _Undecided(exc.reason) from exc
        except GatewayError as error:
            if error.status >= 500:
                raise _Undecided(error.message) from error
            return None
        return tokenized.prompts[0].token_ids


class _Undecided(Exception):
    """Render could not answer a probe (it did not refuse it either)."""


def count_tokens_body(input_tokens: int) -> bytes:
    """`/v1/messages/count_tokens`'s answer, as native serializes it."""
    return orjson.dumps({"input_tokens": input_tokens, "context_management": {"original_input_tokens": input_tokens}})


# -- answers -------------------------------------------------------------------------------


# Statuses native vLLM never answers on /v1/messages, the gateway does: Anthropic's error types.
_GATEWAY_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def anthropic_error(status: int, body: bytes) -> bytes:
    """An OpenAI error body in Anthropic's envelope, as native's `translate_error_response`
    makes it (type and message kept; anything not an OpenAI error becomes its message)."""
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if isinstance(error, dict):
        kind, message = error.get("type"), error.get("message")
    else:
        kind, message = None, body.decode("utf-8", "replace")
    if status in _GATEWAY_TYPES:  # the gateway's own (keys, quotas): Anthropic's types for them
        kind = _GATEWAY_TYPES[status]
    return orjson.dumps(
        {"type": "error", "error": {"type": str(kind or _phrase(status)), "message": str(message or "")}}
    )


def route_error(exc: Exception) -> bytes:
    """An exception in native's route: `translate_error_response(create_error_response(exc))`."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    error = create_error_response(exc).error
    return orjson.dumps({"type": "error", "error": {"type": error.type, "message": error.message}})


def _phrase(status: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def messages_whole(chat_body: bytes) -> tuple[int, bytes]:
    """A whole chat answer as native's whole Messages answer (status, body)."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    try:
        chat = ChatCompletionResponse.model_validate_json(chat_body)
        answer = AnthropicServingMessages.messages_full_converter(None, chat)  # type: ignore[arg-type]
    except Exception as exc:  # native's route turns a converter failure into a 400
        log.info("messages conversion failed: %r", exc)
        return 400, route_error(exc)
    return 200, orjson.dumps(answer.model_dump(mode="json", exclude_none=True))


class MessagesStream:
    """A chat SSE stream in, native's Messages events out: vLLM's `message_stream_converter`
    itself, stepped by hand (`stepped.py`), chunk by chunk."""

    def __init__(self) -> None:
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

        converter = partial(AnthropicServingMessages.message_stream_converter, None)  # type: ignore[arg-type]
        self._stepped: Stepped[str, str] = Stepped(converter)

    @property
    def done(self) -> bool:
        return self._stepped.done

    def convert(self, payloads: list[bytes], end: bool = False) -> bytes:
        """Chat SSE payloads (`data:` values, `[DONE]` included) -> Messages SSE bytes."""
        lines = ("data: " + p.decode() + "\n\n" for p in payloads)
        return "".join(self._stepped.run(lines, end)).encode()

    def ended(self, status: int, body: bytes) -> bytes:
        """Anthropic's error event (an engine's in-band error goes through `convert`, as native)."""
        self._stepped.close()
        return b"event: error\ndata: " + anthropic_error(status, body) + b"\n\n"

    def close(self) -> None:
        self._stepped.close()


class MessagesConversion:
    """A Messages request's answer from its chat answer (`protocol.Conversion`)."""

    def stream(self) -> MessagesStream:
        return MessagesStream()

    def whole(self, body: bytes) -> tuple[int, bytes]:
        return messages_whole(body)

    def error(self, status: int, body: bytes) -> bytes:
        return anthropic_error(status, body)

    async def finished(self) -> None:
        pass  # nothing is kept of a Messages answer


MESSAGES = MessagesConversion()


class MessagesApi:
    """Messages for one base model (`api.routes.ClientApi`): its request converted to chat and
    planned as chat; everything the route refuses in Anthropic's envelope (a body vLLM's
    model refuses keeps native's validation error)."""

    handlers = ("messages", "messages_count_tokens")
    generating = ("messages",)

    def __init__(self, planner: Planner, renderer: Renderer | None, served_name: str) -> None:
        self._planner = planner
        self.frontend = MessagesFrontend(renderer, served_name)

    def error(self, status: int, body: bytes) -> bytes:
        return anthropic_error(status, body)

    async def plan(self, handler: str, body: dict[str, Any], raw: bytes, request_id: str) -> Plan:
        counting = handler == "messages_count_tokens"
        try:
            chat = await self.frontend.chat_body(body, count_tokens=counting)
        except GatewayError as error:  # its body is native's already
            return Local(error.status, error.body)
        raw = orjson.dumps(chat)
        try:
            model = self._planner.catalog.resolve(chat.get("model"))
            request = OpenAIRequest(Pipeline.CHAT, chat, model, conversion=MESSAGES)
            if counting:
                plan: Plan = Local(200, count_tokens_body(await self._planner.counted(request, raw, request_id)))
            else:
                plan = await self._planner.plan(request, raw, request_id)
        except GatewayError as error:
            plan = Local(error.status, error.body)
        if isinstance(plan, Local) and plan.status != 200:
            plan = Local(plan.status, anthropic_error(plan.status, plan.body))
        return plan

    async def refused(self, handler: str, body: dict[str, Any], raw: bytes, request_id: str) -> Local | None:
        from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest

        model = AnthropicCountTokensRequest if handler == "messages_count_tokens" else AnthropicMessagesRequest
        return await refused_by(model, raw)
