"""OpenAI Responses (`/v1/responses`) requests, as native vLLM serves them: with a response
store (`conversation_store`, on by default) as native with `VLLM_ENABLE_RESPONSES_API_STORE=1`,
without one as native without it (the stateless subset).

The body is parsed with vLLM's own `ResponsesRequest` (a body it refuses gets native's
validation error), refused where native refuses it, and named with the gateway's id; a
follow-up (`previous_response_id`) gets its stored conversation as input items
(`responses_history.py`); render (`/v1/responses/render`) then makes its prompt, the rendered
request is served as a completions request, and the answer is made as native makes it
(`responses_answer.py`), then stored (`conversations.py`).
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import ValidationError

from ext_proc.api.body import handled_exception, refused_by, validation_error
from ext_proc.api.conversations import Conversations, native_error
from ext_proc.api.responses_answer import ResponsesServing, Turn
from ext_proc.api.responses_history import dumps, history_items, listed_items, turn_messages
from ext_proc.errors import GatewayError
from ext_proc.extras import PROCESSOR, require
from ext_proc.frontend.render_in_process import RenderRoute
from ext_proc.planning.plan import Local, Plan
from ext_proc.planning.planner import Planner
from ext_proc.protocol import FLOW, Flow, OpenAIRequest, Pipeline

ENDPOINT = "/v1/responses"  # vLLM's: render serves ENDPOINT + "/render", engines ENDPOINT itself

NO_STORE = (
    "This vLLM engine does not support `store=True` and therefore does not support the background mode. "
    "To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` "
    "when launching the vLLM server."
)
BACKGROUND = "background mode is not served by the gateway: ask without `background`"


class ResponsesApi:
    """Responses for one base model (`api.routes.ClientApi`): rendered as such, then served as
    the completions request it is once rendered; None `serving`: not served (501)."""

    handlers = ("responses",)
    generating = handlers

    def __init__(self, planner: Planner, serving: ResponsesServing | None, stored: Conversations) -> None:
        self._planner = planner
        self._serving = serving
        self._stored = stored

    def error(self, status: int, body: bytes) -> bytes:
        return body  # native's Responses errors are OpenAI's

    async def refused(self, handler: str, body: dict[str, Any], raw: bytes, request_id: str) -> Local | None:
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        return await refused_by(ResponsesRequest, raw)

    async def plan(self, handler: str, body: dict[str, Any], raw: bytes, request_id: str) -> Plan:
        try:
            client = await responses_request(raw, request_id, self._stored.enabled)
            if self._serving is None:
                raise GatewayError(501, "the Responses API is not served by this gateway", code="unsupported")
            named = {**body, "request_id": client.request_id}  # render names its prompt with the gateway's id
            turn = await self._turn(client, named)
            raw = orjson.dumps(named)
            request = OpenAIRequest(
                Pipeline.COMPLETIONS, named, self._planner.catalog.resolve(named.get("model")), ENDPOINT
            )
            tokenized = await self._planner.rendered(request, raw, request_id)
            if tokenized.complete:  # (else its engine renders it: the native path, as it came)
                tokenized = self._serving.inside(tokenized, client, turn)
                raw = orjson.dumps(tokenized.request.body)
        except GatewayError as error:
            return Local(error.status, error.body)
        return await self._planner.placed(tokenized, raw)

    async def _turn(self, client: Any, named: dict[str, Any]) -> Turn | None:
        """What is stored of this turn once answered (None: not stored); a follow-up's stored
        conversation put into `named` as input items, for render's stateless route."""
        if not client.store and client.previous_response_id is None:
            return None  # (nothing kept, nothing continued)
        tenant = (FLOW.get() or Flow()).tenant
        previous_messages = previous_output = None
        if client.previous_response_id is not None:
            previous = await self._stored.previous(client.previous_response_id, tenant)
            previous_messages = orjson.loads(previous.messages)
            previous_output = _output_items(previous.response)
        messages = turn_messages(client, previous_messages, previous_output)
        if client.previous_response_id is not None:
            named["input"] = history_items(messages, client.instructions, client.model)
            del named["previous_response_id"]
        if not client.store:
            return None
        return Turn(self._stored, tenant, dumps(messages), dumps(listed_items(client)))


def _output_items(response: bytes) -> list[Any]:
    """A stored answer's output as vLLM's output item objects (native reads its messages' text)."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesResponse

    return list(ResponsesResponse.model_validate_json(response).output)


def render_route() -> RenderRoute:
    """Render's Responses route, for the renderer loaded in process (the sidecar serves it)."""

    def model() -> Any:
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        return ResponsesRequest

    # the stateless Responses render takes no HTTP request (its id is the body's)
    return RenderRoute(model, lambda serving, parsed, caller: serving.render_responses_request(parsed))


async def responses_request(raw: bytes, request_id: str, store: bool) -> Any:
    """vLLM's model of the request body, named `resp_<request id>`; a GatewayError with
    native's status and body when native would refuse it (`store`: with the gateway's response
    store, as native with its own; without: `store` silently off, as native without one).
    (Parsed from the bytes: vLLM's model turns the input items of a dict it validates into
    objects, in place.)"""
    require("the Responses API (vLLM's request model)", PROCESSOR, "vllm")
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.exceptions import VLLMClientError

    try:
        request = ResponsesRequest.model_validate_json(raw)
    except ValidationError as exc:  # native's words are those of its validation (`refused_by`)
        native = await refused_by(ResponsesRequest, raw) or Local(400, await validation_error(exc))
        raise GatewayError(native.status, "invalid request", body=native.body) from exc
    except VLLMClientError as exc:  # a validator of the model's own (`tool_choice` naming no
        # tool): native's exception handler answers it, not a 500
        native = await handled_exception(exc)
        raise GatewayError(native.status, "invalid request", body=native.body) from exc
    request.request_id = f"resp_{request_id}"
    _refuse_unserved(request, store)
    request.store = request.store and store
    return request


def _refuse_unserved(request: Any, store: bool) -> None:
    """What native refuses, in native's order and words (`_validate_create_responses_input`,
    then, without a store, the lookup of the previous response in an empty store); and
    background mode, which the gateway does not serve."""
    if request.background and store:
        raise native_error(400, BACKGROUND, "background")
    if request.store and request.background:
        raise native_error(400, NO_STORE, "background")
    if request.previous_input_messages and request.previous_response_id:
        message = "Only one of `previous_input_messages` and `previous_response_id` can be set."
        raise native_error(400, message, "previous_response_id")
    if request.previous_response_id is not None and not store:
        raise native_error(404, f"Response with id '{request.previous_response_id}' not found.", "response_id")
