"""The route table: which client API serves a route's handler (`listener.routes`), one
`ClientApi` per API family and base model. Nothing outside `ext_proc/api/` knows which API
a request came in; it sees the pipeline request the API made of it."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol

from ext_proc.api.conversations import Conversations
from ext_proc.api.messages import MessagesApi
from ext_proc.api.openai import OpenAIApi
from ext_proc.api.responses import ENDPOINT, ResponsesApi, render_route
from ext_proc.api.responses_answer import ResponsesServing
from ext_proc.api.tokenize import TokenizeApi, in_process_routes
from ext_proc.config import ModelConfig
from ext_proc.derender.model import DerenderModel
from ext_proc.frontend.render import Renderer
from ext_proc.frontend.render_in_process import RenderRoute
from ext_proc.planning.plan import Local, Plan
from ext_proc.planning.planner import Planner


class ClientApi(Protocol):
    """One client API family: the handlers it serves, how a request of it is planned (parsed
    into the pipeline request, its answer's conversion and derender needs set on that
    request), and its error envelope."""

    @property
    def handlers(self) -> Collection[str]:
        """The route handlers (`listener.routes`) it serves."""
        ...

    @property
    def generating(self) -> Collection[str]:
        """Those of its handlers whose requests an engine generates for: they take admission's
        room, so a full queue may turn them away from their headers."""
        ...

    def error(self, status: int, body: bytes) -> bytes:
        """An OpenAI error body (what shared parts answer) in this API's envelope."""
        ...

    async def plan(self, handler: str, body: dict[str, Any], raw: bytes, request_id: str) -> Plan:
        """`body`: `raw` parsed (a JSON object) whose `model` is the planner's base model's."""
        ...

    async def refused(self, handler: str, body: dict[str, Any], raw: bytes, request_id: str) -> Local | None:
        """Native's answer, in this API's envelope, when its request model refuses `body`
        (None: it does not): native validates a body before it looks up its model, so a body
        naming no model served gets this answer first."""
        ...


def client_apis(
    planner: Planner,
    renderer: Renderer | None,
    model: ModelConfig,
    derender: DerenderModel | None = None,
    stored: Conversations | None = None,
) -> dict[str, ClientApi]:
    """Each handler's API for one base model (`derender`: its answers' model; None: the APIs
    that make their answers from it are not served; `stored`: the process's stored Responses,
    None: none are kept)."""
    responses = None if derender is None else ResponsesServing(derender, model.max_model_len)
    apis: list[ClientApi] = [
        OpenAIApi(planner),
        MessagesApi(planner, renderer, model.served_name),
        ResponsesApi(planner, responses, stored or Conversations()),
        TokenizeApi(renderer, model.served_name),
    ]
    return {handler: api for api in apis for handler in api.handlers}


def render_routes() -> dict[str, RenderRoute]:
    """The routes of vLLM's render server, by path, that client APIs add to the pipelines'
    render routes (for the renderer loaded in process; the sidecar serves them all)."""
    return {ENDPOINT + "/render": render_route(), **in_process_routes()}
