"""A protocol-faithful vLLM engine simulator (token-only generate + native routes).

For what a CPU vLLM cannot do on cue: deterministic scripted tokens, many instances in
well under a second, and a record of every request it received. It speaks the wire format
of vLLM 0.32 `--enable-scale-out` (shared/docs/vllm-scale-out-protocol.md §4): non-stream
`GenerateTokensResponse`, SSE `GenerateStreamResponse` chunks with one choice each, a
finish chunk with `weight_versions`, the `choices: []` usage chunk, `data: [DONE]`, and
`generate-tokens-<X-Request-Id>` ids.

Run one as a process: `python -m tests.engine_sim --port 8300`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

VOCAB = 900  # stays inside the tiny model's vocabulary, so real derender can decode it
FIRST_ID = 10  # skip the special tokens


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class EngineSim:
    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 0
    token_delay_s: float = 0.0
    received: list[Received] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- scripted output ----------------------------------------------------------------

    @staticmethod
    def script(prompt_ids: list[int], n: int) -> list[int]:
        """Deterministic output derived from the prompt."""
        seed = sum(prompt_ids) + len(prompt_ids)
        return [FIRST_ID + (seed + 7 * i) % (VOCAB - FIRST_ID) for i in range(n)]

    # -- routes -------------------------------------------------------------------------

    async def _record(self, request: Request) -> bytes:
        body = await request.body()
        self.received.append(Received(request.url.path, dict(request.headers), body))
        return body

    async def generate(self, request: Request) -> Response:
        body = json.loads(await self._record(request))
        if body.get("model") not in (None, self.model):
            return _error(404, f"The model `{body['model']}` does not exist.", "NotFoundError")
        if not body.get("token_ids"):
            return _error(400, "token_ids: List should have at least 1 item", "Bad Request")
        params = body.get("sampling_params") or {}
        max_tokens = int(params.get("max_tokens", 16))
        request_id = "generate-tokens-" + (request.headers.get("x-request-id") or body.get("request_id") or uuid.uuid4().hex)
        tokens = self.script(body["token_ids"], max_tokens)
        usage = {"prompt_tokens": len(body["token_ids"]), "total_tokens": len(body["token_ids"]) + len(tokens),
                 "completion_tokens": len(tokens)}
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._stream(request_id, tokens, usage, include_usage), media_type="text/event-stream")
        return JSONResponse({
            "request_id": request_id, "model": self.model, "created": int(time.time()), "usage": {
                **usage, "prompt_tokens_details": None, "completion_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None, "mm_placeholders": None,
            "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None, "output_mode": "tokens",
            "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": tokens,
                         "routed_experts": None, "sampling_mask": None,
                         "weight_versions": [{"version": "default", "start": 0, "end": len(tokens)}], "logprobs": None}],
        })

    async def _stream(self, request_id: str, tokens: list[int], usage: dict[str, int], include_usage: bool) -> AsyncIterator[bytes]:
        for i, token in enumerate(tokens):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            last = i == len(tokens) - 1
            choice = {"index": 0, "finish_reason": "length" if last else None, "stop_reason": None, "token_ids": [token],
                      "routed_experts": None, "sampling_mask": None,
                      "weight_versions": [{"version": "default", "start": 0, "end": len(tokens)}] if last else None,
                      "logprobs": None}
            yield _sse({"request_id": request_id, "usage": None, "output_mode": "tokens", "choices": [choice]})
        if include_usage:
            yield _sse({"request_id": request_id, "usage": usage, "output_mode": "tokens", "choices": []})
        yield b"data: [DONE]\n\n"

    async def native(self, request: Request) -> Response:
        body = json.loads(await self._record(request))
        chat = request.url.path.endswith("chat/completions")
        prompts = [0] if chat or not isinstance(body.get("prompt"), list) else range(len(body["prompt"]))
        choices = [
            {"index": i, "message": {"role": "assistant", "content": "sim"}, "finish_reason": "length"} if chat
            else {"index": i, "text": "sim", "finish_reason": "length"}
            for i in prompts
        ]
        return JSONResponse({"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "object":
                             "chat.completion" if chat else "text_completion", "created": int(time.time()),
                             "model": self.model, "choices": choices,
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async def models(self, request: Request) -> Response:
        await self._record(request)
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "sim"}]})

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/inference/v1/generate", self.generate, methods=["POST"]),
            Route("/v1/chat/completions", self.native, methods=["POST"]),
            Route("/v1/completions", self.native, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ])

    def generate_requests(self) -> list[Received]:
        return [r for r in self.received if r.path == "/inference/v1/generate"]


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status_code=status)


class SimServer:
    """An EngineSim served by uvicorn on a background thread of the test process."""

    def __init__(self, sim: EngineSim) -> None:
        self.sim = sim
        config = uvicorn.Config(sim.app(), host=sim.host, port=sim.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> SimServer:
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)
        self.sim.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    sim = EngineSim(model=args.model, host=args.host, port=args.port, token_delay_s=args.token_delay_ms / 1000)
    uvicorn.run(sim.app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
