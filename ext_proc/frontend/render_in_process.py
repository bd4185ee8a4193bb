"""Render in the processor: vLLM's own `ServingRender`, the object `vllm launch render` serves,
built from the same flags as the sidecar and called without the HTTP hop. Its answers are
serialized exactly as the sidecar's routes serialize them and go through the same outcome
mapping (`render.rendered`), so the gateway cannot tell the two apart except by latency.

Loading imports vLLM and reads the model's config: seconds, once at start-up."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from ext_proc.config import ModelConfig
from ext_proc.extras import PROCESSOR, require
from ext_proc.frontend import render_parser_cache, render_prefix_cache
from ext_proc.frontend.render import rendered, tokenized
from ext_proc.frontend.render_parser_cache import ReusedParsers
from ext_proc.frontend.render_prefix_cache import PrefixTokenCache
from ext_proc.protocol import NOT_FOR_ENGINES, OpenAIRequest, Pipeline, TokenizedRequest
from render_sidecar.launch import model_flags

log = logging.getLogger("tito.render")


@dataclass(frozen=True)
class RenderRoute:
    """One route of vLLM's render server: the request model its body is validated with, and
    the `ServingRender` call that renders it (serving, parsed body, HTTP request)."""

    model: Callable[[], Any]
    render: Callable[[Any, Any, Any], Awaitable[Any]]


def _chat_model() -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest


def _completion_model() -> Any:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest


def as_fastapi_validates(model: Any, body: Any) -> Any:
    """`body` (parsed JSON) validated as FastAPI validates a route's body (`fastapi/_compat/v2.py`:
    Python mode, from attributes), so a refusal carries native's words: "a valid list", not
    JSON mode's "a valid array"; "a valid dictionary or object to extract fields from"."""
    if isinstance(model, type) and issubclass(model, BaseModel):
        return model.model_validate(body, from_attributes=True)
    return model.validate_python(body, from_attributes=True)  # a TypeAdapter (a union of models)


def request_model(pipeline: Pipeline) -> Any:
    """vLLM's request model of a pipeline's route (what its render and its API server validate with)."""
    return _chat_model() if pipeline is Pipeline.CHAT else _completion_model()


_CHAT = RenderRoute(_chat_model, lambda serving, parsed, caller: serving.render_chat_request(parsed, caller))
_COMPLETIONS = RenderRoute(
    _completion_model, lambda serving, parsed, caller: serving.render_completion_request(parsed, caller)
)


class InProcessRender:
    def __init__(
        self,
        serving: Any,
        args: Any,
        prefix_cache: PrefixTokenCache | None = None,
        parsers: ReusedParsers | None = None,
    ) -> None:
        self._serving = serving
        self._args = args
        self.prefix_cache = prefix_cache  # token ids per piece of chat text (None: off)
        self.parsers = parsers  # parsers built once per distinct construction (None: off)
        # the render server's routes it answers, by path (`serve` adds a client API's)
        self.routes = {Pipeline.CHAT.value + "/render": _CHAT, Pipeline.COMPLETIONS.value + "/render": _COMPLETIONS}

    @classmethod
    async def load(
        cls, model: ModelConfig, prefix_cache: bool = False, max_ids: int = 2_000_000, reuse_parsers: bool = False
    ) -> InProcessRender:
        """`prefix_cache`: tokenize chat text through the prefix cache (`render_prefix_cache.py`);
        `reuse_parsers`: build each distinct parser once (`render_parser_cache.py`)."""
        require("render_config.mode: in_process (vLLM's renderer)", PROCESSOR, "vllm")
        from starlette.datastructures import State
        from vllm import AsyncEngineArgs
        from vllm.config import VllmConfig
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.entrypoints.launchers.render.app_state import init_render_app_state
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        if not model.path:
            raise ValueError("in-process render needs model.path")
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(model_flags(model, model.path))  # type: ignore[no-untyped-call]
        engine_args = AsyncEngineArgs.from_cli_args(args)
        model_config = engine_args.create_model_config()
        model_config.quantization = None  # as `vllm launch render`: preprocessing only
        vllm_config = VllmConfig(
            model_config=model_config,
            logging_config=engine_args.create_logging_config(),
            structured_outputs_config=engine_args.create_structured_outputs_config(),
        )
        state = State()
        await init_render_app_state(vllm_config, state, args)
        serving = state.serving_render
        cache = None
        if prefix_cache:
            renderer = serving.online_renderer.renderer
            cache = PrefixTokenCache(renderer.get_tokenizer(), max_ids)
            render_prefix_cache.install(renderer, cache)
        parsers = render_parser_cache.install(serving.online_renderer) if reuse_parsers else None
        return cls(serving, args, cache, parsers)

    def serve(self, path: str, route: RenderRoute) -> None:
        """Answer `path` as vLLM's render server's route of that path does (chat and
        completions render are built in; a client API room adds its own)."""
        self.routes[path] = route

    async def render(self, request: OpenAIRequest, raw: bytes, request_id: str) -> TokenizedRequest:
        status, answer, parsed = await self._result(request.endpoint + "/render", raw, request_id)
        if isinstance(answer, bytes):
            return rendered(request, status, answer)
        if _same_request(request, parsed):  # derender reads it rather than validating it again
            request = replace(request, validated=parsed)
        # vLLM's GenerateRequest(s) as the JSON the sidecar would send, without writing and
        # parsing that JSON (0.2 ms per request)
        return tokenized(request, _dumped(answer, mode="json"))

    def close(self) -> None:
        """Nothing held open: the renderer lives as long as the process."""

    async def answer(self, path: str, raw: bytes, request_id: str) -> tuple[int, bytes]:
        """(status, body) as the sidecar's route `path` would answer."""
        from fastapi.responses import JSONResponse

        status, answer, _ = await self._result(path, raw, request_id)
        if isinstance(answer, bytes):
            return status, answer
        return status, bytes(JSONResponse(content=_dumped(answer, mode="python")).body)

    async def _result(self, path: str, raw: bytes, request_id: str) -> tuple[int, Any, Any]:
        """(status, error body, None) as the sidecar's route would answer, or (200, what vLLM
        rendered, the request as vLLM's model validated it)."""
        from fastapi.responses import JSONResponse
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        route = self.routes.get(path)
        if route is None:  # as the sidecar answers a route it does not serve
            return 404, b'{"detail":"Not Found"}', None
        caller = self._caller(request_id)
        try:
            parsed = as_fastapi_validates(route.model(), orjson.loads(raw))
            result: Any = await route.render(self._serving, parsed, caller)
        except ValidationError as exc:
            return *await self._invalid(exc), None
        except Exception as exc:  # what the sidecar's exception handlers answer (400 for bad input,
            # also a request model's own VLLMValidationError, which FastAPI lets through to them)
            from vllm.entrypoints.serve.exception_handling.handlers.exception import exception_handler

            log.info("in-process render raised %r", exc)
            response = await exception_handler(caller, exc)
            return response.status_code, bytes(response.body), None
        if isinstance(result, ErrorResponse):
            return result.error.code, bytes(JSONResponse(content=result.model_dump()).body), None
        return 200, result, parsed

    async def _invalid(self, exc: ValidationError) -> tuple[int, bytes]:
        """vLLM's own 400 for a request its models refuse (FastAPI locates errors in `body`)."""
        from fastapi.exceptions import RequestValidationError
        from vllm.entrypoints.serve.exception_handling.handlers.validation import validation_exception_handler

        errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
        response = await validation_exception_handler(self._caller(""), RequestValidationError(errors))
        return response.status_code, bytes(response.body)

    def _caller(self, request_id: str) -> Any:
        """What vLLM's route code reads of the HTTP request: the request id header the sidecar
        gets, and the server's args (for its error handlers)."""
        app = SimpleNamespace(state=SimpleNamespace(args=self._args))
        return SimpleNamespace(headers={"X-Request-Id": request_id}, app=app, state=SimpleNamespace())


def _same_request(request: OpenAIRequest, parsed: Any) -> bool:
    """`parsed` is what derender would validate: the pipeline's own request class (not a
    client API's rendered at its own path) of the same body. Render got it under the base
    model's name (an alias or adapter: another `model`), and derender keeps the body without
    the fields no derender reads (`kept`): bodies with either are validated again."""
    return (
        request.path is None
        and getattr(parsed, "model", None) == request.body.get("model")
        and not any(key in request.body for key in NOT_FOR_ENGINES)
    )


def _dumped(result: Any, mode: str) -> Any:
    """A chat render's GenerateRequest, or a completion render's list of them, as plain data."""
    if isinstance(result, list):
        return [item.model_dump(mode=mode) for item in result]
    return result.model_dump(mode=mode)
