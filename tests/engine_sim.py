"""A protocol-faithful vLLM engine simulator (token-only generate + native routes).

For what a CPU vLLM cannot do on cue: deterministic scripted tokens, many instances in
well under a second, and a record of every request it received. It speaks the wire format
of vLLM 0.32 `--enable-scale-out` (shared/docs/vllm-scale-out-protocol.md §4): non-stream
`GenerateTokensResponse`, SSE `GenerateStreamResponse` chunks with one choice each, a
finish chunk with `weight_versions`, the `choices: []` usage chunk, `data: [DONE]`, and
`generate-tokens-<X-Request-Id>` ids. Prefill/decode: a generate whose `kv_transfer_params`
say `do_remote_decode` is a prefill leg (one token, and NIXL-style pull params in the
answer); a decode leg whose params carry a `metaserver` (Trigger) first POSTs the callback
a layer-wise decode engine makes, and fails if the gateway does not answer 200. `GET /metrics`
is vLLM's Prometheus text for the few families load balancing reads: the generate requests
in progress as running, plus an `external_load` that stands for other gateways' traffic.

Run one as a process: `python -m tests.engine_sim --port 8300`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ext_proc.obfuscation import ObfuscationProvider
from tests.servers import ThreadedServer

NATIVE_TEXT = "native answer"
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
class Fault:
    """What goes wrong, on cue. kinds:
    - `status`: answer `status` (e.g. 500, 503, 404, 501) before any output;
    - `inband_error`: after `after_tokens` tokens, a `data: {"error": …}` event, then `[DONE]`;
    - `abort`: after `after_tokens` tokens, drop the TCP connection mid-body;
    - `stall`: after `after_tokens` tokens, send nothing more (until the client leaves);
    - `garbage`: after `after_tokens` tokens, one event that is JSON but no generate event,
      then the rest of the stream as if nothing happened (derender fails on it).
    Refusing connections is `SimServer.stop()` (and `restart()` to come back)."""

    kind: str
    status: int = 500
    after_tokens: int = 0
    times: int | None = None  # how many requests it hits (None: all)


class AbortStream(Exception):
    """Raised inside a streaming body: the server drops the connection mid-response."""


def vllm_block_stored(hashes: Sequence[bytes | int], token_ids: list[int], block_size: int) -> Any:
    """vLLM's `BlockStored` event for the first `len(hashes)` full blocks of `token_ids`."""
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=token_ids[: len(hashes) * block_size],
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


class SimKvEvents:
    """What an engine started with --kv-events-config and --prefix-caching-hash-algo sha256_cbor
    publishes, by vLLM's own parts: its ZMQ publisher (with the replay socket) and its block
    hash. Every prompt's full blocks are announced as stored (a simulator holds everything it
    was sent). `paused`: the stream goes silent while requests still come (a stuck publisher)."""

    def __init__(self, port: int, replay_port: int, block_size: int) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core import kv_cache_utils

        kv_cache_utils.init_none_hash(sha256_cbor)
        self.block_size = block_size
        self.paused = False
        self.endpoint, self.replay_endpoint = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
        self._publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}")

    def stored(self, prompt: list[int]) -> None:
        from vllm.distributed.kv_events import KVEventBatch
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core import kv_cache_utils

        size, parent, hashes = self.block_size, None, []
        for start in range(0, len(prompt) // size * size, size):
            parent = kv_cache_utils.hash_block_tokens(sha256_cbor, parent, prompt[start : start + size])
            hashes.append(kv_cache_utils.maybe_convert_block_hash(parent))
        if hashes and not self.paused:
            event = vllm_block_stored(hashes, prompt, size)
            self._publisher.publish(KVEventBatch(ts=time.time(), events=[event]))

    def close(self) -> None:
        self._publisher.shutdown()


@dataclass
class EngineSim:
    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 0
    ttft_s: float = 0.0
    token_delay_s: float = 0.0
    tokens: list[int] | None = None  # scripted output for every request (default: from the prompt)
    # how scripted output ends: "stop" with stop_reason None is an EOS/stop-token end (the
    # last scripted id is that token), a string stop_reason a stop-string end
    finish_reason: str = "length"
    stop_reason: int | str | None = None
    fault: Fault | None = None
    pad_bytes: int = 0  # non-streaming generate answers carry this much padding (oversized responses)
    received: list[Received] = field(default_factory=list)
    streams_cut: int = 0  # generate streams the client (Envoy) left before the end
    trigger_callbacks: list[int] = field(default_factory=list)  # metaserver answers (Trigger decode)
    # "obfuscated weights": ids in and out are physical. The prompt is de-permuted before the
    # scripted output is derived from it, and the output permuted, so only a gateway that
    # obfuscates with the same secret gets the text it would get without obfuscation.
    obfuscation: ObfuscationProvider | None = None
    running: int = 0  # generate requests in progress (until their last byte is sent)
    # What other gateways' requests add to /metrics: (running, waiting, kv_usage 0..1). The
    # simulator holds no KV cache of its own: its usage is this figure alone.
    external_load: tuple[int, int, float] = (0, 0, 0.0)
    metrics_status: int = 200  # anything else: /metrics fails with it
    kv_blocks: int = 1000  # the KV cache /metrics reports: kv_blocks × block_size tokens
    block_size: int = 128  # a CPU engine's (and pools[].block_size's default)
    kv_events: SimKvEvents | None = None  # `publish_kv_events`: what --kv-events-config publishes
    # What capability negotiation reads: vLLM's version, the context it announces, whether it
    # runs with --enable-scale-out (else generate answers 0.32's 403), the prefix-caching hash
    # it reports, and its tokenization of the gateway's canary chat (None: no /tokenize).
    version: str = "0.32.0"
    max_model_len: int = 2048
    scale_out: bool = True
    hash_algo: str = "sha256_cbor"  # what `tito up` starts engines with (the gateway's KV-event hash)
    canary_ids: list[int] | None = None
    probes: list[str] = field(default_factory=list)  # paths the gateway's capability probes asked for
    # LoRA adapters it serves (name -> path; --lora-modules, and /v1/load_lora_adapter adds):
    # an adapter's output is scripted apart from the base's, so a test sees it was applied.
    adapters: dict[str, str] = field(default_factory=dict)
    loaded: list[str] = field(default_factory=list)  # adapters /v1/load_lora_adapter was asked for

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def publish_kv_events(self, port: int, replay_port: int) -> SimKvEvents:
        """From now on, announce each prompt's full blocks as a vLLM engine does."""
        self.kv_events = SimKvEvents(port, replay_port, self.block_size)
        return self.kv_events

    # -- scripted output ----------------------------------------------------------------

    @staticmethod
    def script(prompt_ids: list[int], n: int) -> list[int]:
        """Deterministic output derived from the prompt."""
        seed = sum(prompt_ids) + len(prompt_ids)
        return [FIRST_ID + (seed + 7 * i) % (VOCAB - FIRST_ID) for i in range(n)]

    def prefill_params(self, request_id: str, prompt: list[int]) -> dict[str, Any]:
        """What a NIXL prefill engine returns: where decode pulls the prompt's KV from."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"sim-{self.port}",
            "remote_request_id": request_id,
            "remote_block_ids": [list(range((len(prompt) + 15) // 16))],
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_num_tokens": len(prompt),
        }

    async def _call_metaserver(self, url: str, request_id: str) -> int:
        """What a layer-wise (Trigger) decode engine does once it can receive KV."""
        params = {"do_remote_prefill": True, "remote_engine_id": f"sim-{self.port}", "metaserver": url}
        async with httpx.AsyncClient(trust_env=False) as client:
            response = await client.post(url, json={"request_id": request_id, "kv_transfer_params": params}, timeout=30)
        self.trigger_callbacks.append(response.status_code)
        return response.status_code

    def _take_fault(self) -> Fault | None:
        fault = self.fault
        if fault is None:
            return None
        if fault.times is not None:  # one Fault may be shared by several sims: hits counted across them
            if fault.times <= 0:
                self.fault = None
                return None
            fault.times -= 1
        return fault

    # -- routes -------------------------------------------------------------------------

    async def _record(self, request: Request) -> bytes:
        """The request's body; recorded unless it is a capability probe (tests count what
        clients caused)."""
        body = await request.body()
        if _is_probe(request):
            self.probes.append(request.url.path)
        else:
            self.received.append(Received(request.url.path, dict(request.headers), body))
        return body

    async def generate(self, request: Request) -> Response:
        body = json.loads(await self._record(request))
        absent = self.fault is not None and self.fault.kind == "status" and self.fault.status in (404, 405, 501)
        if absent and _is_probe(request):  # a route that is missing is missing for the probe too
            return JSONResponse({"detail": "Not Found"}, status_code=self.fault.status)  # type: ignore[union-attr]
        if not self.scale_out:  # what vLLM 0.32 answers without --enable-scale-out
            message = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
            return _error(403, message, "PermissionDeniedError")
        model = body.get("model") or self.model
        if model != self.model and model not in self.adapters:
            message = f"The model `{model}` does not exist. Valid aliases: {self.model}."
            return _error(404, message, "NotFoundError", param="model")
        if not body.get("token_ids"):
            return _error(400, "token_ids: List should have at least 1 item", "Bad Request")
        fault = self._take_fault()
        if fault is not None and fault.kind == "status":
            if fault.status in (404, 405, 501):  # an engine without the token-only route
                return JSONResponse({"detail": "Not Found"}, status_code=fault.status)
            return _error(fault.status, f"simulated engine failure {fault.status}", "EngineError")
        params = body.get("sampling_params") or {}
        max_tokens = int(params.get("max_tokens", 16))
        request_id = "generate-tokens-" + (
            request.headers.get("x-request-id") or body.get("request_id") or uuid.uuid4().hex
        )
        n = int(params.get("n", 1))  # choice c > 0 is scripted from the prompt and c
        prompt = body["token_ids"]
        if self.kv_events is not None:
            self.kv_events.stored(prompt)
        if self.obfuscation is not None:
            prompt = self.obfuscation.deobfuscate(prompt)
        lora = [FIRST_ID + len(model)] if model != self.model else []  # an adapter's own output
        outputs = [
            (self.tokens or self.script(prompt + lora + [c] * bool(c), max_tokens))[:max_tokens] for c in range(n)
        ]
        tokens = outputs[0]
        finish = self.finish_reason if self.tokens and len(self.tokens) <= max_tokens else "length"
        stop_reason = self.stop_reason if finish == "stop" else None
        top_k = params.get("logprobs")
        completion = sum(len(output) for output in outputs)
        usage = {
            "prompt_tokens": len(body["token_ids"]),
            "total_tokens": len(body["token_ids"]) + completion,
            "completion_tokens": completion,
        }
        kv_params = body.get("kv_transfer_params") or {}
        if kv_params.get("metaserver"):  # a Trigger decode leg: ask the gateway for the prefill first
            status = await self._call_metaserver(kv_params["metaserver"], request_id)
            if status != 200:
                return _error(500, f"trigger callback answered {status}", "KVTransferError")
        if kv_params.get("do_remote_decode"):  # a prefill leg: one token, KV kept for decode
            outputs, finish = [tokens[:1]], "length"
            kv_params = self.prefill_params(request_id, body["token_ids"])
        else:
            kv_params = None
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            interval = int(params.get("stream_interval") or 1)
            end = (finish, stop_reason, top_k, interval)
            events = self._stream(request_id, outputs, usage, include_usage, fault, end)
            return StreamingResponse(events, media_type="text/event-stream")
        if self.ttft_s or self.token_delay_s:
            await asyncio.sleep(self.ttft_s + self.token_delay_s * len(tokens))
        return JSONResponse(
            {
                "request_id": request_id,
                "model": model,
                "created": int(time.time()),
                "usage": {**usage, "prompt_tokens_details": None, "completion_tokens_details": None},
                "prompt_logprobs": self._physical_prompt(_prompt_logprobs(prompt, params.get("prompt_logprobs"))),
                "prompt_token_id_logprobs": None,
                "prompt_token_ids": None,
                "mm_placeholders": None,
                "metrics": None,
                "kv_transfer_params": kv_params,
                "ec_transfer_params": None,
                "output_mode": "tokens",
                **({"padding": "x" * self.pad_bytes} if self.pad_bytes else {}),
                "choices": [
                    self._physical(
                        {
                            "index": c,
                            "finish_reason": finish,
                            "stop_reason": stop_reason,
                            "token_ids": output,
                            "routed_experts": None,
                            "sampling_mask": None,
                            "weight_versions": [{"version": "default", "start": 0, "end": len(output)}],
                            "logprobs": _logprobs(output, top_k),
                        }
                    )
                    for c, output in enumerate(outputs)
                ],
            }
        )

    async def _stream(self, *args: Any) -> AsyncIterator[bytes]:
        """`_events`, counting the streams the client (Envoy) left before the end."""
        finished = False
        try:
            async for event in self._events(*args):
                yield event
            finished = True
        finally:
            self.streams_cut += not finished

    async def _events(
        self,
        request_id: str,
        outputs: list[list[int]],
        usage: dict[str, int],
        include_usage: bool,
        fault: Fault | None,
        end: tuple[str, int | str | None, int | None, int],
    ) -> AsyncIterator[bytes]:
        """One event per step and choice (choices interleaved, as the engine emits them); with
        `stream_interval: k` a step is the first token alone, then k tokens, then the rest, as
        vLLM's output processor sends them. A fault strikes at step `after_tokens`."""
        finish, stop_reason, top_k, interval = end
        if self.ttft_s:
            await asyncio.sleep(self.ttft_s)
        steps = [_intervals(output, interval) for output in outputs]
        starts = [list(accumulate((len(step) for step in choice[:-1]), initial=0)) for choice in steps]
        for i in range(max(len(output) for output in steps)):
            if fault is not None and i == fault.after_tokens:
                if fault.kind == "inband_error":
                    yield _sse(
                        {
                            "error": {
                                "message": "simulated engine core failure",
                                "type": "InternalServerError",
                                "param": None,
                                "code": 500,
                            }
                        }
                    )
                    yield b"data: [DONE]\n\n"
                    return
                if fault.kind == "abort":
                    raise AbortStream()
                if fault.kind == "stall":
                    await asyncio.Event().wait()
                if fault.kind == "garbage":
                    yield _sse({"request_id": request_id, "choices": 5})
            if self.token_delay_s and i:
                await asyncio.sleep(self.token_delay_s * len(steps[0][i] if i < len(steps[0]) else [0]))
            for c, (tokens, choice_steps) in enumerate(zip(outputs, steps, strict=True)):
                if i >= len(choice_steps):
                    continue
                last = i == len(choice_steps) - 1
                choice = {
                    "index": c,
                    "finish_reason": finish if last else None,
                    "stop_reason": stop_reason if last else None,
                    "token_ids": choice_steps[i],
                    "routed_experts": None,
                    "sampling_mask": None,
                    "weight_versions": [{"version": "default", "start": 0, "end": len(tokens)}] if last else None,
                    "logprobs": _logprobs(choice_steps[i], top_k, starts[c][i]),
                }
                event = {
                    "request_id": request_id,
                    "usage": None,
                    "output_mode": "tokens",
                    "choices": [self._physical(choice)],
                }
                yield _sse(event)
        if include_usage:
            yield _sse({"request_id": request_id, "usage": usage, "output_mode": "tokens", "choices": []})
        yield b"data: [DONE]\n\n"

    def _physical(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A choice's ids as obfuscated weights emit them (as is without obfuscation)."""
        if self.obfuscation is None:
            return choice
        permute = self.obfuscation.obfuscate
        logprobs = choice["logprobs"]
        if logprobs is not None:
            for entry in logprobs["content"]:
                entry["token_id"] = permute([entry["token_id"]])[0]
                for top in entry["top_logprobs"]:
                    top["token_id"] = permute([top["token_id"]])[0]
        stop = choice.get("stop_reason")
        if isinstance(stop, int):  # the stop token the engine stopped on: one of its own ids
            choice = {**choice, "stop_reason": permute([stop])[0]}
        return {**choice, "token_ids": permute(choice["token_ids"])}

    def _physical_prompt(self, prompt_logprobs: list[Any] | None) -> list[Any] | None:
        """Prompt logprobs keyed by the ids obfuscated weights compute on."""
        if self.obfuscation is None or prompt_logprobs is None:
            return prompt_logprobs
        permute = self.obfuscation.obfuscate
        return [None if p is None else {str(permute([int(k)])[0]): v for k, v in p.items()} for p in prompt_logprobs]

    async def native(self, request: Request) -> Response:
        """The engine's own OpenAI endpoints (the native path): a fixed short answer."""
        body = json.loads(await self._record(request))
        if self.ttft_s:
            await asyncio.sleep(self.ttft_s)
        chat = request.url.path.endswith("chat/completions")
        n_prompts = 1 if chat or not isinstance(body.get("prompt"), list) else len(body["prompt"])
        kind = "chatcmpl-" if chat else "cmpl-"
        rid = kind + uuid.uuid4().hex
        if body.get("stream"):
            return StreamingResponse(self._native_stream(rid, chat, n_prompts), media_type="text/event-stream")
        choices = [
            {"index": i, "message": {"role": "assistant", "content": NATIVE_TEXT}, "finish_reason": "length"}
            if chat
            else {"index": i, "text": NATIVE_TEXT, "finish_reason": "length"}
            for i in range(n_prompts)
        ]
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": choices,
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def _native_stream(self, rid: str, chat: bool, n_prompts: int) -> AsyncIterator[bytes]:
        for i in range(n_prompts):
            choice = (
                {"index": i, "delta": {"role": "assistant", "content": NATIVE_TEXT}, "finish_reason": "length"}
                if chat
                else {"index": i, "text": NATIVE_TEXT, "finish_reason": "length"}
            )
            yield _sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": int(time.time()),
                    "model": self.model,
                    "choices": [choice],
                }
            )
        yield b"data: [DONE]\n\n"

    async def native_responses(self, request: Request) -> Response:
        """The engine's own OpenAI Responses endpoint: a fixed short answer, whole or as
        native's events (created, then completed)."""
        body = json.loads(await self._record(request))
        rid = body.get("request_id") or "resp_" + uuid.uuid4().hex
        message = {"type": "output_text", "text": NATIVE_TEXT, "annotations": [], "logprobs": None}
        usage = {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2, "input_tokens_details": {"cached_tokens": 0}}
        response = {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "model": self.model,
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "id": "msg_" + rid,
                    "role": "assistant",
                    "status": "completed",
                    "content": [message],
                }
            ],
            "usage": usage,
        }
        if not body.get("stream"):
            return JSONResponse(response)

        async def events() -> AsyncIterator[bytes]:
            created = {**response, "status": "in_progress", "output": [], "usage": None}
            for n, (kind, answer) in enumerate([("response.created", created), ("response.completed", response)]):
                yield f"event: {kind}\n".encode() + _sse({"type": kind, "sequence_number": n, "response": answer})

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(self, request: Request) -> Response:
        await self._record(request)
        fault = None if _is_probe(request) else self._take_fault()
        if fault is not None and fault.kind == "status":
            return _error(fault.status, f"simulated engine failure {fault.status}", "EngineError")
        model = {"id": self.model, "object": "model", "owned_by": "sim", "root": "/sim/" + self.model}
        adapters = [
            {
                "id": name,
                "object": "model",
                "owned_by": "sim",
                "root": path,
                "parent": self.model,
                "max_model_len": None,
            }
            for name, path in self.adapters.items()
        ]
        return JSONResponse(
            {"object": "list", "data": [{**model, "parent": None, "max_model_len": self.max_model_len}, *adapters]}
        )

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's admin route (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1): 400 for a name it holds."""
        body = json.loads(await self._record(request))
        name = body["lora_name"]
        self.loaded.append(name)
        if name in self.adapters:
            message = f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
            return _error(400, message, "InvalidUserInput")
        self.adapters[name] = body["lora_path"]
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def version_info(self, request: Request) -> Response:
        await self._record(request)
        fault = None if _is_probe(request) else self._take_fault()
        if fault is not None and fault.kind == "status":
            return _error(fault.status, f"simulated engine failure {fault.status}", "EngineError")
        return JSONResponse({"version": self.version})

    async def tokenize(self, request: Request) -> Response:
        await self._record(request)
        if self.canary_ids is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        ids = self.canary_ids
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None})

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        """vLLM 0.32's exposition of what load balancing reads (one engine core), recorded."""
        await self._record(request)
        if self.metrics_status != 200:
            return _error(self.metrics_status, "simulated metrics failure", "EngineError")
        running, waiting, kv_usage = self.external_load
        labels = f'engine="0",model_name="{self.model}"'
        cache = (
            f'block_size="{self.block_size}",cache_dtype="auto",engine="0",num_gpu_blocks="{self.kv_blocks}",'
            f'prefix_caching_hash_algo="{self.hash_algo}"'
        )
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(self.running + running)}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}",
            "# TYPE vllm:num_requests_waiting_by_reason gauge",
            f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} {float(waiting)}',
            f'vllm:num_requests_waiting_by_reason{{{labels},reason="deferred"}} 0.0',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {float(kv_usage)}",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{{cache},num_gpu_blocks_override="None"}} 1.0',
        ]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")

    async def other(self, request: Request) -> Response:
        """Every other engine route (abort, tokenize, scale_elastic_ep, ...): recorded,
        so a test can prove none was reached; scale_elastic_ep fails like a real engine's."""
        await self._record(request)
        if request.url.path == "/scale_elastic_ep":
            return _error(500, "scale_elastic_ep failed", "InternalServerError")
        return JSONResponse({})

    async def control(self, request: Request) -> Response:
        """Process mode: `POST /sim/control {"ttft_s", "token_delay_s", "tokens", "fault": {…}|null}`;
        `GET /sim/control` returns what was received."""
        if request.method == "GET":
            return JSONResponse(
                [{"path": r.path, "headers": r.headers, "body": r.body.decode()} for r in self.received]
            )
        update = await request.json()
        for key in (
            "ttft_s",
            "token_delay_s",
            "tokens",
            "finish_reason",
            "stop_reason",
            "pad_bytes",
            "metrics_status",
            "scale_out",
            "max_model_len",
            "canary_ids",
        ):
            if key in update:
                setattr(self, key, update[key])
        if "external_load" in update:
            running, waiting, kv_usage = update["external_load"]
            self.external_load = (running, waiting, kv_usage)
        if "fault" in update:
            self.fault = Fault(**update["fault"]) if update["fault"] else None
        return JSONResponse({"ok": True})

    def app(self) -> ASGIApp:
        routes = Starlette(
            routes=[
                Route("/inference/v1/generate", self.generate, methods=["POST"]),
                Route("/v1/chat/completions", self.native, methods=["POST"]),
                Route("/v1/completions", self.native, methods=["POST"]),
                Route("/v1/responses", self.native_responses, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
                Route("/version", self.version_info, methods=["GET"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/sim/control", self.control, methods=["GET", "POST"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/{path:path}", self.other, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
            ]
        )

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            # around the whole exchange, so a stream counts as running until its last byte
            generate = scope["type"] == "http" and scope["path"] == "/inference/v1/generate"
            self.running += generate
            try:
                await routes(scope, receive, send)
            finally:
                self.running -= generate

        return app

    def generate_requests(self) -> list[Received]:
        return [r for r in self.received if r.path == "/inference/v1/generate"]


def _is_probe(request: Request) -> bool:
    return request.headers.get("user-agent") == "tito-capabilities"  # ext_proc/fleet/capabilities.py


def _logprobs(tokens: list[int], top_k: int | None, start: int = 0) -> dict[str, Any] | None:
    """Generate's `GenerateLogProbs` (0.32): per token the sampled entry, then a list cut to
    max(k, 1) entries in all, sampled first; deterministic values derived from the ids and
    their place in the output (`start`: of the first), however the events cut it."""
    if top_k is None:
        return None
    content = []
    for i, token in enumerate(tokens, start):
        rank = 1 + (token + i) % 3  # sometimes the sampled token is the top candidate
        sampled = {"token_id": token, "logprob": -0.25 * rank, "rank": rank}
        others = [FIRST_ID + (token * 7 + r) % (VOCAB - FIRST_ID) for r in range(1, top_k + 2)]
        ranked = [{"token_id": t, "logprob": -0.25 * r, "rank": r} for r, t in enumerate(others, 1) if r != rank]
        if rank <= top_k + 1:
            ranked.insert(rank - 1, sampled)
        tops = [sampled] + [t for t in ranked if t["token_id"] != token]
        content.append({**sampled, "top_logprobs": tops[: max(top_k, 1)]})
    return {"content": content}


def _intervals(tokens: list[int], k: int) -> list[list[int]]:
    """A choice's output as the engine's events carry it at `stream_interval` k."""
    if not tokens:
        return []
    return [tokens[:1]] + [tokens[i : i + k] for i in range(1, len(tokens), k)]


def _prompt_logprobs(prompt: list[int], top_k: int | None) -> list[Any] | None:
    """A whole answer's `prompt_logprobs` (only whole answers carry them): None for the first
    position, then the prompt's id first and k candidates, deterministic from the ids. Their
    `decoded_token` is the engine's decoding, which the gateway must not rely on (under
    obfuscation it would be of physical ids)."""
    if top_k is None:
        return None
    out: list[Any] = [None]
    for i, token in enumerate(prompt[1:]):
        rank = 1 + (token + i) % 3
        position = {str(token): {"logprob": -0.5 * rank, "rank": rank, "decoded_token": "?"}}
        for r in range(1, top_k + 1):
            other = FIRST_ID + (token * 5 + r) % (VOCAB - FIRST_ID)
            position.setdefault(str(other), {"logprob": -0.5 * r, "rank": r, "decoded_token": "?"})
        out.append(position)
    return out


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status
    )


class SimServer(ThreadedServer):
    """An EngineSim on a background thread; `stop()` makes it refuse connections."""

    def __init__(self, sim: EngineSim) -> None:
        super().__init__(sim.app(), sim.host, sim.port)
        self.sim = sim

    def start(self) -> SimServer:
        super().start()
        self.sim.port = self.port
        return self

    def close(self) -> None:
        """Stop for good: its KV event publisher too."""
        self.stop()
        if self.sim.kv_events is not None:
            self.sim.kv_events.close()


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
