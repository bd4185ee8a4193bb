"""OpenAI chat and completions (`/v1/chat/completions`, `/v1/completions`): the two pipelines
themselves, so the request goes in as the client sent it and the answer comes out as the
pipeline makes it. Render validates the body with native's request models (its answers are
native's), and the frontend checks client token ids as native's engine does."""

from __future__ import annotations

from typing import Any

from ext_proc.api.body import refused_by
from ext_proc.derender.streaming import DONE_EVENT, sse_event
from ext_proc.errors import GatewayError
from ext_proc.frontend.render_in_process import request_model
from ext_proc.planning.plan import Local, Plan
from ext_proc.planning.planner import Planner
from ext_proc.protocol import OpenAIRequest, Pipeline

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"  # native's, for a stream it answers


class OpenAIApi:
    """Chat and completions for one base model (`api.routes.ClientApi`)."""

    handlers = {"chat": Pipeline.CHAT, "completions": Pipeline.COMPLETIONS}
    generating = tuple(handlers)

    def __init__(self, planner: Planner) -> None:
        self._planner = planner

    def error(self, status: int, body: bytes) -> bytes:
        return body  # the pipelines' errors are OpenAI's

    async def plan(self, handler: str, body: dict[str, Any], raw: bytes, request_id: str) -> Plan:
        try:
            request = OpenAIRequest(self.handlers[handler], body, self._planner.catalog.resolve(body.get("model")))
        except GatewayError as error:
            return Local(error.status, error.body)
        plan = await self._planner.plan(request, raw, request_id)
        if isinstance(plan, Local) and plan.in_stream:
            return streamed_error(plan)
        return plan

    async def refused(self, handler: str, body: dict[str, Any], raw: bytes, request_id: str) -> Local | None:
        return await refused_by(request_model(self.handlers[handler]), raw)


def streamed_error(refusal: Local) -> Local:
    """An error native's engine finds while generating, as a streaming request gets it: the
    stream's only event, then [DONE] (`completion_stream_generator`'s `except`)."""
    return Local(200, sse_event(refusal.body) + DONE_EVENT, content_type=SSE_CONTENT_TYPE)
