"""OpenAI Responses answers, made as native vLLM makes them, from a completions answer.

Inside the gateway a Responses request is a completions request once rendered (`inside`,
with the answer made per step: `OpenAIRequest.per_step`):
its prompt is render's ids, its sampling parameters render's, and it asks for the output ids
and the usage. Everything between render and the client is then completions': admission,
scheduling, P/D, relay, obfuscation and derender (the engine's detokenizer, stop strings).
What native adds on top is per step: the reasoning and tool parser's `parse_delta`, then
`split_delta` and the event processor, framed by `response.created` ... `response.completed`.
The gateway runs exactly that code: vLLM's own `responses_stream_generator` and
`responses_full_generator`, on an `OpenAIServingResponses` made without an engine, fed with
one `RequestOutput` per completions step (text, ids, finish) through a `SimpleContext`, as
native's engine loop feeds them (`stepped.py` runs the generator by hand).

The completions stream keeps one chunk per engine step for these requests (no merging, see
`derender/session.py`), so the parser sees native's steps.

Output logprobs (`include: ["message.output_text.logprobs"]`) ride along as completions
logprobs naming token ids (`return_tokens_as_token_ids`): texts would not do, as distinct
candidates often decode alike (byte-fallback pieces to ""), and a completions `top_logprobs`
dict keyed by text keeps only one of them. Each step's ids are decoded here as the engine
decodes logprob tokens, into the `dict[id, Logprob]` per position native's code reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import orjson

from ext_proc.api.conversations import Conversations, stored_turn
from ext_proc.api.stepped import Stepped, run_coroutine
from ext_proc.derender.logprobs import token_id_of
from ext_proc.derender.model import DerenderModel, cached_tokens
from ext_proc.derender.streaming import DONE
from ext_proc.errors import GatewayError
from ext_proc.protocol import DEFAULT_MAX_TOKENS, OpenAIRequest, Pipeline, TokenizedRequest

log = logging.getLogger("tito.responses")

# Render's sampling parameters a completions request takes under the same name (an engine
# without token-only generate gets the request on its native completions endpoint).
_COMPLETION_PARAMS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "structured_outputs",
    "logprobs",  # the output logprobs' `top_logprobs`, set only when they are included
)
# SamplingParams' defaults, for the fields the answer echoes (render leaves defaults out)
_ECHOED = {
    "temperature": 1.0,
    "top_p": 1.0,
    "max_tokens": DEFAULT_MAX_TOKENS,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logprobs": None,
}


class ResponsesServing:
    """One base model's Responses answers: vLLM's `OpenAIServingResponses` without an engine
    (only its answer-making methods run), the derender model's tokenizer and parser class."""

    def __init__(self, model: DerenderModel, max_model_len: int) -> None:
        from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

        self.model = model
        self._max_model_len = max_model_len
        serving = object.__new__(OpenAIServingResponses)
        vars(serving).update(
            use_harmony=False,
            enable_store=False,
            enable_log_outputs=False,
            request_logger=None,
            enable_auto_tools=model.enable_auto_tools,
            enable_per_request_metrics=False,
            return_tokens_as_token_ids=False,
            tool_server=None,
            parser=model.parser_cls,
            response_store=_Unkept(),  # (the gateway keeps stored answers itself: `Turn`)
            response_store_lock=asyncio.Lock(),
        )
        self.serving = serving

    def inside(self, tokenized: TokenizedRequest, client: Any, turn: Turn | None = None) -> TokenizedRequest:
        """A rendered Responses request as the completions request the gateway serves; the
        engine is asked for the usage at the end of a stream (its cached tokens)."""
        prompt = tokenized.prompts[0]
        if len(prompt.token_ids) >= self._max_model_len:  # native's `_validate_generator_input`
            message = (
                f"The engine prompt length {len(prompt.token_ids)} exceeds the max_model_len "
                f"{self._max_model_len}. Please reduce prompt."
            )
            raise GatewayError(400, message, param="input", code=400, kind="invalid_request_error")
        for generate in (prompt.generate_request, prompt.engine_request):
            if generate is not None and tokenized.stream:
                generate["stream_options"] = {"include_usage": True}
        params = prompt.sampling_params
        body: dict[str, Any] = {k: params[k] for k in _COMPLETION_PARAMS if params.get(k) is not None}
        body.update(model=tokenized.request.model, prompt=prompt.token_ids, return_token_ids=True)
        if "logprobs" in body:  # logprob tokens as ids, decoded by `ResponsesAnswer.output`
            body["return_tokens_as_token_ids"] = True
        if tokenized.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        model_name = tokenized.request.response_model(self.model.served_name)
        answer = ResponsesAnswer(self, client, prompt.token_ids, params, model_name, turn)
        client_request = tokenized.request.kept()  # what an engine's own /v1/responses gets (native leg)
        request = OpenAIRequest(
            Pipeline.COMPLETIONS,
            body,
            tokenized.request.adapter,
            conversion=answer,
            per_step=True,
            native=client_request,
        )
        return replace(tokenized, request=request)


@dataclass(frozen=True)
class Turn:
    """What is stored of a turn once it is answered (`store`): where, whose, the chat messages
    the next turn starts from and the input items `input_items` lists (JSON)."""

    stored: Conversations
    tenant: str | None
    messages: bytes
    items: bytes


class _Unkept(dict[str, Any]):
    """vLLM's own response store, which its answer-making code writes when `store` is on: the
    gateway keeps nothing here (it would grow forever), it stores the answer itself."""

    def __setitem__(self, key: str, value: Any) -> None:
        pass


class ResponsesAnswer:
    """One Responses request's answer from its completions answer (`protocol.Conversion`)."""

    def __init__(
        self,
        serving: ResponsesServing,
        client: Any,
        prompt_ids: list[int],
        params: dict[str, Any],
        model_name: str,
        turn: Turn | None = None,
    ) -> None:
        self._serving = serving
        self.client = client  # vLLM's ResponsesRequest
        self.prompt_ids = prompt_ids
        self.sampling = SimpleNamespace(**{k: params.get(k, default) for k, default in _ECHOED.items()})
        self.model_name = model_name
        self._logprob_context: list[int] = []  # the last sampled ids, across steps (`LogprobDecoder`)
        self._turn = turn
        self.final: Any = None  # the whole answer (vLLM's ResponsesResponse), once made

    async def finished(self) -> None:
        """The answer is made: a stored turn is kept before its last byte reaches the client,
        so a follow-up sent the moment it arrives finds it."""
        if self._turn is not None and self.final is not None:
            turn, self._turn = self._turn, None
            await turn.stored.keep(stored_turn(self.final, turn.messages, turn.items, turn.tenant))

    def context(self) -> Any:
        """Native's `SimpleContext`, with the request's own parser primed with the prompt."""
        from vllm.entrypoints.openai.responses.context import SimpleContext

        model = self._serving.model
        parser = None
        if model.parser_cls is not None:
            kwargs = self.client.build_chat_params(model.chat_template, "auto").chat_template_kwargs
            parser = model.parser_cls(
                model.tokenizer, self.client.tools, chat_template_kwargs=kwargs, model_config=None
            )
            parser.set_prompt_token_ids(self.prompt_ids)
        return SimpleContext(response_parser=parser)

    def output(self, choice: dict[str, Any], usage: Any = None) -> Any:
        """One completions choice (a step, or the whole answer) as the engine's RequestOutput,
        with the prompt's cache counts of a whole answer's `usage`."""
        from vllm.outputs import CompletionOutput, RequestOutput

        finish = choice.get("finish_reason")
        cache = self.cache_counts(usage)
        completion = CompletionOutput(
            index=0,
            text=choice.get("text") or "",
            token_ids=list(choice.get("token_ids") or []),
            cumulative_logprob=None,
            logprobs=self._sample_logprobs(choice.get("logprobs")),
            finish_reason=finish,
            stop_reason=choice.get("stop_reason"),
        )
        return RequestOutput(
            request_id=self.client.request_id,
            prompt=None,
            prompt_token_ids=self.prompt_ids,
            prompt_logprobs=None,
            outputs=[completion],
            finished=finish is not None,
            num_cached_tokens=cache.cached,
            num_cache_creation_tokens=cache.created,
        )

    def cache_counts(self, usage: Any) -> _CacheCounts:
        """The engine's prefix-cache hits and writes for the prompt, as native's context holds
        them (0 when the engine reports none: it runs without `--enable-prompt-tokens-details`)."""
        cached = cached_tokens(usage)
        if cached is None:
            return _CacheCounts(0, 0)
        details = self._serving.model.prompt_details(True, len(self.prompt_ids), cached, whole=True)
        return _CacheCounts(cached, details["created_cache_tokens"])

    def _sample_logprobs(self, logprobs: dict[str, Any] | None) -> list[dict[int, Any]] | None:
        """A completions choice's token-id logprobs as the engine's `SampleLogprobs`: per
        position the sampled id first, then the candidates in the engine's order, decoded with
        the engine's rules. (Ranks are not in a completions answer; native's Responses answer
        does not read them.)"""
        from vllm.logprobs import Logprob

        if logprobs is None:
            return None
        content = [
            {
                "token_id": token_id_of(token),
                "logprob": logprob,
                "top_logprobs": [{"token_id": token_id_of(t), "logprob": v} for t, v in (top or {}).items()],
            }
            for token, logprob, top in zip(
                logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
            )
        ]
        positions = self._serving.model.logprobs.positions({"content": content}, self._logprob_context)
        return [
            {c.token_id: Logprob(logprob=c.logprob, rank=c.rank, decoded_token=c.text) for c in p.candidates}
            for p in positions
        ]

    def generator_args(self, context: Any, created: int) -> tuple[Any, ...]:
        from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata

        metadata = RequestResponseMetadata(request_id=self.client.request_id)
        return (self.sampling, context, self.model_name, self._serving.model.tokenizer, metadata, created)

    def stream(self) -> ResponsesStream:
        return ResponsesStream(self)

    def whole(self, body: bytes) -> tuple[int, bytes]:
        """A whole completions answer as native's whole Responses answer."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        try:
            completion = orjson.loads(body)
            context = self.context()
            context.append_output(self.output(completion["choices"][0], completion.get("usage")))
            sampling, *rest = self.generator_args(context, int(time.time()))
            serving = self._serving.serving
            answer = run_coroutine(serving.responses_full_generator(self.client, sampling, _nothing(), *rest))
        except Exception as exc:  # noqa: BLE001 - the client gets a clear error, the log the cause
            log.exception("responses answer failed for %s", self.client.request_id)
            error = GatewayError(500, f"derender failed: {exc!r}", code="derender_failed")
            return error.status, error.body
        if isinstance(answer, ErrorResponse):
            return answer.error.code, orjson.dumps(answer.model_dump(mode="json", by_alias=True))
        self.final = answer
        return 200, orjson.dumps(answer.model_dump(mode="json", by_alias=True))

    def error(self, status: int, body: bytes) -> bytes:
        return body  # native's Responses errors are OpenAI's


@dataclass(frozen=True)
class _CacheCounts:
    """The end of a completions stream, as far as Responses' usage goes: the prompt's
    prefix-cache hits and writes."""

    cached: int
    created: int


class ResponsesStream:
    """A completions stream in, native's Responses events out (`protocol.StreamConversion`)."""

    def __init__(self, answer: ResponsesAnswer) -> None:
        self._answer = answer
        self._context = answer.context()
        serving, client = answer._serving.serving, answer.client
        args = answer.generator_args(self._context, int(time.time()))

        def events(steps: AsyncIterator[Any]) -> AsyncIterator[Any]:
            return serving.responses_stream_generator(client, args[0], self._contexts(steps), *args[1:])

        self._stepped: Stepped[Any, Any] = Stepped(events)
        self._sent = 0  # events so far: the next one's sequence number

    async def _contexts(self, steps: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Native's engine loop: each output appended to the context, the context yielded."""
        async for step in steps:
            if isinstance(step, _CacheCounts):
                self._context.num_cached_tokens = step.cached
                self._context.num_cache_creation_tokens = step.created
                continue
            self._context.append_output(step)
            yield self._context

    def convert(self, payloads: list[bytes], end: bool = False) -> bytes:
        steps: list[Any] = []
        error: dict[str, Any] | None = None
        for payload in payloads:
            if payload == DONE:
                end = True
                continue
            chunk = orjson.loads(payload)
            if isinstance(chunk.get("error"), dict):  # the stream's end: an error instead of the rest
                error, end = chunk["error"], True
                break
            steps += [self._answer.output(choice) for choice in chunk.get("choices") or []]
            if chunk.get("usage") is not None and not chunk.get("choices"):
                steps.append(self._answer.cache_counts(chunk["usage"]))
        out = self._frames(self._stepped.run(steps))
        if error is not None:
            self._stepped.close()  # what native would still say after an error is not said
            return out + self._error_frame(error)
        return out + (self._frames(self._stepped.run([], end=True)) if end else b"")

    def ended(self, status: int, body: bytes) -> bytes:
        return self.convert([body], end=True)  # (an error chunk: the stream's error event)

    def close(self) -> None:
        self._stepped.close()

    def _frames(self, events: list[Any]) -> bytes:
        """As native's route frames them (`_convert_stream_to_sse_events`)."""
        self._sent += len(events)
        for event in events:
            if getattr(event, "type", None) == "response.completed":  # the whole answer, as stored
                self._answer.final = event.response
        return "".join(
            f"event: {getattr(e, 'type', 'unknown')}\ndata: {e.model_dump_json(indent=None, by_alias=True)}\n\n"
            for e in events
        ).encode()

    def _error_frame(self, error: dict[str, Any]) -> bytes:
        """The stream's error event (OpenAI's `ResponseErrorEvent`), after what was sent."""
        code = error.get("code")
        event = {
            "type": "error",
            "code": None if code is None else str(code),
            "message": str(error.get("message") or ""),
            "param": error.get("param"),
            "sequence_number": self._sent,
        }
        self._sent += 1
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


async def _nothing() -> AsyncIterator[Any]:
    return
    yield
