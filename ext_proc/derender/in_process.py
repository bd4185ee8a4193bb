"""In-process derender: live state per choice, the way coupled vLLM serving derenders.

Native serving keeps, per choice, the engine's incremental detokenizer (which also holds back
and cuts stop strings) and one reasoning/tool parser object, and feeds both only each step's
new token ids. This module does exactly that with vLLM's own classes (tokenizer loading,
`IncrementalDetokenizer`, `ParserManager`, the protocol models), and assembles chunks and
responses by the rules of `OpenAIServingChat` / `OpenAIServingCompletion` (0.32), so the
client sees what the engine's own OpenAI endpoint would send. Per chunk the work is
O(new ids); nothing is replayed. Nothing here does I/O: it is CPU work called from the
derender pipeline.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import orjson

from ext_proc.config import ModelConfig
from ext_proc.derender.logprobs import LogprobDecoder, chat_logprobs, completion_logprobs
from ext_proc.derender.streaming import sse_event
from ext_proc.extras import PROCESSOR, require
from ext_proc.protocol import ApiKind, PromptTokens, TokenizedRequest

log = logging.getLogger("tito.derender")


class DerenderModel:
    """What every request of one processor shares: tokenizer, parser class, decoder.

    Loading imports vLLM (and torch): seconds, so it happens once at start-up."""

    def __init__(self, config: ModelConfig) -> None:
        require("derender (the engines' tokenizer, detokenizer and parsers)", PROCESSOR, "vllm")
        if not config.path:
            raise ValueError("in-process derender needs model.path (the engines' tokenizer)")
        from vllm.parser import ParserManager
        from vllm.tokenizers import get_tokenizer

        self.served_name = config.served_name
        self.chat_template = config.chat_template
        self.enable_auto_tools = config.enable_auto_tool_choice
        self.tokenizer = get_tokenizer(config.path)
        self.parser_cls = ParserManager.get_parser(
            tool_parser_name=config.tool_call_parser,
            reasoning_parser_name=config.reasoning_parser,
            enable_auto_tools=config.enable_auto_tool_choice,
            model_name=config.path,
            tokenizer=self.tokenizer,
        )
        self.logprobs = LogprobDecoder(self.tokenizer)
        self.include_reasoning_details = bool(config.reasoning_parser)

    def client_request(self, request: TokenizedRequest) -> Any:
        """vLLM's own model of the client request, as native serving validates it."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        cls = ChatCompletionRequest if request.api is ApiKind.CHAT else CompletionRequest
        return cls.model_validate(request.request.body)

    def parser(self, client: Any) -> Any:
        if self.parser_cls is None:
            return None
        kwargs = client.build_chat_params(self.chat_template, "auto").chat_template_kwargs
        return self.parser_cls(self.tokenizer, client.tools, chat_template_kwargs=kwargs, model_config=None)

    def detokenizer(self, prompt: PromptTokens, params: dict[str, Any]) -> Any:
        """The engine's own incremental detokenizer, primed with the prompt like the engine's."""
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        sampling = SimpleNamespace(
            stop=params.get("stop"),
            min_tokens=params.get("min_tokens", 0),
            include_stop_str_in_output=params.get("include_stop_str_in_output", False),
            skip_special_tokens=params.get("skip_special_tokens", True),
            spaces_between_special_tokens=params.get("spaces_between_special_tokens", True),
        )
        engine_request = SimpleNamespace(
            sampling_params=sampling, prompt_token_ids=prompt.token_ids, prompt_embeds=None, request_id=""
        )
        return IncrementalDetokenizer.from_new_request(self.tokenizer, engine_request)  # type: ignore[arg-type]


@dataclass
class _Choice:
    """One choice's live state: detokenizer window, parser, counters. Grows only with the
    output itself (the detokenizer's text, the parser's text, the ids for reasoning counts)."""

    detokenizer: Any
    parser: Any
    num_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    tools_streamed: bool = False
    finished: bool = False
    logprob_context: list[int] = field(default_factory=list)
    text_offset: int = 0  # completions: where the next logprob token starts

    def text(self, ids: list[int], finish_reason: str | None, stop_reason: Any) -> str:
        # EOS and stop ids end generation in the engine core and are not detokenized;
        # a stop *string* is found (and cut) by the detokenizer itself.
        stop_terminated = finish_reason == "stop" and not isinstance(stop_reason, str)
        self.detokenizer.update(ids, stop_terminated)
        return str(self.detokenizer.get_next_output_text(finish_reason is not None, True))


@dataclass(frozen=True)
class _Step:
    """One choice's new output in one engine event: one parser step, as natively."""

    index: int
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: Any
    logprobs: dict[str, Any] | None


def _steps(event: dict[str, Any]) -> list[_Step]:
    return [
        _Step(
            int(c.get("index", 0)),
            list(c.get("token_ids") or []),
            c.get("finish_reason"),
            c.get("stop_reason"),
            c.get("logprobs"),
        )
        for c in event.get("choices") or []
    ]


class _Session:
    """Shared by the chat and completions sessions: the request, its choices, usage."""

    _object = ""  # the chunks' `object`

    def __init__(self, model: DerenderModel, request: TokenizedRequest, prompt_index: int, client: Any) -> None:
        self._model = model
        self._request = request
        self._prompt = request.prompts[prompt_index]
        self._client = client
        self._params = self._prompt.sampling_params
        self._n = int(client.n or 1)
        self._created = int(time.time())
        self._choices: dict[int, _Choice] = {}
        self._started = False
        usage = client.stream_options
        self._include_usage = bool(usage and usage.include_usage)
        self._continuous_usage = self._include_usage and bool(usage.continuous_usage_stats)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self._choices.values())

    def _choice(self, index: int, parser: bool) -> _Choice:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice(
                self._model.detokenizer(self._prompt, self._params),
                self._model.parser(self._client) if parser else None,
            )
        return choice

    def _logprob_positions(self, choice: _Choice, step: _Step) -> list[Any]:
        return self._model.logprobs.positions(step.logprobs, choice.logprob_context)

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self._request.request_id,
            "object": self._object,
            "created": self._created,
            "model": self._model.served_name,
            "choices": choices,
            **extra,
        }

    def steps(self, events: list[dict[str, Any]]) -> bytes:
        """Events that arrived together: each is one parser step, exactly as the engine sent
        it (so parser state and usage match native serving), and consecutive plain-text
        chunks of one choice go out as one chunk."""
        chunks: list[dict[str, Any]] = []
        for event in events:
            for chunk in self._event(event):
                merged = _merge(chunks[-1], chunk) if chunks else None
                if merged is None:
                    chunks.append(chunk)
                else:
                    chunks[-1] = merged
        return b"".join(sse_event(orjson.dumps(chunk)) for chunk in chunks)

    def _event(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._prelude()
        for step in _steps(event):
            chunk = self._step(step)
            if chunk is not None:
                out.append(chunk)
        if event.get("usage") is not None and not event.get("choices") and self._include_usage:
            out.append(self._usage_chunk())
        return out

    def _prelude(self) -> list[dict[str, Any]]:
        """Chunks due before the first event's own (none, unless a subclass says so)."""
        return []

    def _step(self, step: _Step) -> dict[str, Any] | None:
        raise NotImplementedError

    def _usage_chunk(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def _prompt_tokens(self) -> int:
        return len(self._prompt.token_ids)


class ChatStream(_Session):
    """`OpenAIServingChat.chat_completion_stream_generator`, fed by generate events."""

    _object = "chat.completion.chunk"

    def __init__(self, model: DerenderModel, request: TokenizedRequest, prompt_index: int = 0) -> None:
        client = model.client_request(request)
        super().__init__(model, request, prompt_index, client)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam

        self._named_tool = isinstance(client.tool_choice, ChatCompletionNamedToolChoiceParam)
        self._hide_metadata = not client.include_reasoning and model.parser_cls is not None
        for i in range(self._n):  # parsers are made when the stream starts, as natively
            self._choice(i, parser=True)

    def _prelude(self) -> list[dict[str, Any]]:
        """Native serving's first chunks: the role, once per choice."""
        if self._started:
            return []
        self._started = True
        out = []
        ids = self._prompt.token_ids if self._client.return_token_ids else None
        extra: dict[str, Any] = {"prompt_token_ids": ids, "prompt_text": None}
        for i in range(self._n):
            choice: dict[str, Any] = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            if self._continuous_usage:
                extra["usage"] = self._usage(0, 0)
            out.append(self._chunk([choice], **extra))
        return out

    def _step(self, step: _Step) -> dict[str, Any] | None:
        choice = self._choice(step.index, parser=True)
        if choice.finished:
            return None
        logprobs = None
        if self._client.logprobs:
            logprobs = chat_logprobs(self._logprob_positions(choice, step), self._client.top_logprobs)
        text = choice.text(step.token_ids, step.finish_reason, step.stop_reason)
        if not text and not step.token_ids and not choice.num_tokens:
            return None
        if choice.parser is not None:
            delta = choice.parser.parse_delta(
                delta_text=text,
                delta_token_ids=step.token_ids,
                request=self._client,
                prompt_token_ids=self._prompt.token_ids,
                finished=step.finish_reason is not None,
            )
            if delta is not None and delta.tool_calls:
                choice.tools_streamed = True
            if self._model.include_reasoning_details:
                choice.output_ids.extend(step.token_ids)
            delta_json = _delta_json(delta)
        else:
            delta_json = {"content": text}
        choice.num_tokens += len(step.token_ids)
        if self._hide_metadata:
            logprobs = None
        include_ids = self._client.return_token_ids and not self._hide_metadata
        if delta_json is None:
            if step.finish_reason is None and logprobs is None and not include_ids:
                return None
            delta_json = {}
        data: dict[str, Any] = {"index": step.index, "delta": delta_json, "logprobs": logprobs}
        if step.finish_reason is None:
            data["finish_reason"] = None
        else:
            choice.finished = True
            tool_calls = choice.tools_streamed and not self._named_tool and step.finish_reason == "stop"
            data["finish_reason"] = "tool_calls" if tool_calls else step.finish_reason
            data["stop_reason"] = step.stop_reason
        data["token_ids"] = step.token_ids if include_ids else None
        if self._client.parallel_tool_calls is False and "tool_calls" in delta_json:
            delta_json["tool_calls"] = [tc for tc in delta_json["tool_calls"] if tc.get("index") == 0]
        extra: dict[str, Any] = {}
        if self._continuous_usage:
            extra["usage"] = self._usage(choice.num_tokens, self._reasoning_tokens(choice))
        return self._chunk([data], **extra)

    def _reasoning_tokens(self, choice: _Choice) -> int:
        if choice.parser is None or not choice.output_ids:
            return 0
        return int(choice.parser.count_reasoning_tokens(tuple(choice.output_ids)))

    def _usage(self, completion_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self._prompt_tokens,
            "total_tokens": self._prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        if self._model.include_reasoning_details:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage

    def reasoning_tokens(self) -> int:
        """What native usage reports as `completion_tokens_details.reasoning_tokens` so far."""
        return sum(self._reasoning_tokens(c) for c in self._choices.values())

    def _usage_chunk(self) -> dict[str, Any]:
        completion = sum(c.num_tokens for c in self._choices.values())
        usage = {k: v for k, v in self._usage(completion, self.reasoning_tokens()).items() if v is not None}
        return self._chunk([], usage=usage)


_TEXT_KEYS = frozenset({"content", "reasoning", "text"})


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """Two chunks of one choice as one, when only text (content, reasoning, completion text)
    and per-token lists (logprobs, token ids) are in them; None otherwise (tool calls, role,
    finish, usage and prompt ids always keep their own chunk)."""
    if a.keys() != b.keys() or "usage" in a or len(a["choices"]) != 1 or len(b["choices"]) != 1:
        return None
    x, y = a["choices"][0], b["choices"][0]
    if x["index"] != y["index"] or x.get("finish_reason") or y.get("finish_reason") or x.get("prompt_token_ids"):
        return None
    if "delta" in x:
        dx, dy = x["delta"], y["delta"]
        if dx.keys() != dy.keys() or not dx.keys() <= _TEXT_KEYS or not all(isinstance(dx[k], str) for k in dx):
            return None
        merged = {**x, "delta": {k: dx[k] + dy[k] for k in dx}}
    else:
        merged = {**x, "text": x["text"] + y["text"]}
    for key in ("token_ids",):
        if x.get(key) is not None:
            merged[key] = x[key] + y[key]
    if x.get("logprobs") is not None:
        merged["logprobs"] = {k: v + y["logprobs"][k] for k, v in x["logprobs"].items()}
    return {**a, "choices": [merged]}


def _delta_json(delta: Any) -> dict[str, Any] | None:
    if delta is None:
        return None
    data: dict[str, Any] = delta.model_dump(exclude_unset=True)
    return data


class CompletionStream(_Session):
    """`OpenAIServingCompletion.completion_stream_generator` for one prompt."""

    _object = "text_completion"

    def __init__(self, model: DerenderModel, request: TokenizedRequest, prompt_index: int = 0) -> None:
        super().__init__(model, request, prompt_index, model.client_request(request))
        self._prompt_index = prompt_index

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = self._prompt_tokens
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion_tokens,
            "completion_tokens": completion_tokens,
        }

    def _usage_chunk(self) -> dict[str, Any]:
        return self._chunk([], usage=self._usage(sum(c.num_tokens for c in self._choices.values())))

    def _step(self, step: _Step) -> dict[str, Any] | None:
        choice = self._choice(step.index, parser=False)
        text = choice.text(step.token_ids, step.finish_reason, step.stop_reason)
        index = step.index + self._prompt_index * self._n
        if not text and not step.token_ids and not choice.num_tokens:
            return None
        logprobs = None
        if self._client.logprobs is not None:
            positions = self._logprob_positions(choice, step)
            logprobs = completion_logprobs(positions, self._client.logprobs, choice.text_offset)
            if logprobs["tokens"]:
                choice.text_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        choice.num_tokens += len(step.token_ids)
        data: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": step.finish_reason,
            "stop_reason": step.stop_reason,
            "prompt_token_ids": None,
            "token_ids": step.token_ids if self._client.return_token_ids else None,
        }
        if self._client.return_token_ids and choice.num_tokens == len(step.token_ids):
            data["prompt_token_ids"] = self._prompt.token_ids
        extra: dict[str, Any] = {}
        if self._continuous_usage:
            extra["usage"] = self._usage(choice.num_tokens)
        return self._chunk([data], **extra)


def stream_session(
    model: DerenderModel, request: TokenizedRequest, prompt_index: int = 0
) -> ChatStream | CompletionStream:
    if request.api is ApiKind.CHAT:
        return ChatStream(model, request, prompt_index)
    return CompletionStream(model, request, prompt_index)


# -- whole (non-streaming) responses --------------------------------------------------------


def derender_whole(model: DerenderModel, request: TokenizedRequest, generate: dict[str, Any]) -> bytes:
    """One GenerateResponse -> the OpenAI JSON body native serving returns (one step over all
    ids with the same detokenizer; one `parser.parse` per choice, as natively)."""
    if request.api is ApiKind.CHAT:
        return _chat_response(model, request, generate)
    return _completion_response(model, request, generate)


def _final_text(model: DerenderModel, prompt: PromptTokens, params: dict[str, Any], choice: dict[str, Any]) -> str:
    detokenizer = model.detokenizer(prompt, params)
    state = _Choice(detokenizer, None)
    state.text(list(choice.get("token_ids") or []), choice.get("finish_reason"), choice.get("stop_reason"))
    return str(detokenizer.get_next_output_text(True, False))


def _chat_response(model: DerenderModel, request: TokenizedRequest, generate: dict[str, Any]) -> bytes:
    from vllm.entrypoints.generate.base.protocol import ToolCall
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionLogProbs,
        ChatCompletionNamedToolChoiceParam,
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.serve.engine.protocol import CompletionTokenUsageInfo, UsageInfo
    from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls
    from vllm.renderers.chat_utils import make_tool_call_id

    client = model.client_request(request)
    prompt = request.prompts[0]
    named = client.tool_choice is not None and type(client.tool_choice) is ChatCompletionNamedToolChoiceParam
    required = client.tool_choice == "required"
    tool_parser = model.parser_cls.tool_parser_cls if model.parser_cls is not None else None
    choices = []
    total_reasoning = 0
    completion_tokens = 0
    for output in generate.get("choices") or []:
        token_ids = list(output.get("token_ids") or [])
        completion_tokens += len(token_ids)
        text = _final_text(model, prompt, prompt.sampling_params, output)
        logprobs = None
        if client.logprobs:
            positions = model.logprobs.positions(output.get("logprobs"), [])
            logprobs = chat_logprobs(positions, client.top_logprobs)
        parser = model.parser(client)
        suppress = False
        if parser is not None:
            parser.set_prompt_token_ids(prompt.token_ids)
            reasoning, content, tool_calls = parser.parse(
                text, client, enable_auto_tools=model.enable_auto_tools, model_output_token_ids=token_ids
            )
            suppress = not client.include_reasoning
            if not client.include_reasoning:
                reasoning = None
            total_reasoning += parser.count_reasoning_tokens(token_ids)
            if suppress:
                logprobs = None
        else:
            reasoning, content, tool_calls = None, text, []
        calls = [ToolCall(id=tc.id or make_tool_call_id(), function=tc) for tc in (tool_calls or [])]
        auto_called = False
        if named or required:
            message = ChatMessage(role="assistant", reasoning=reasoning, content=content or "", tool_calls=calls)
        elif (
            model.enable_auto_tools and tool_parser and client.tools and client.tool_choice in ("auto", None) and calls
        ):
            auto_called = True
            message = ChatMessage(role="assistant", reasoning=reasoning, content=content, tool_calls=calls)
        else:
            message = ChatMessage(role="assistant", reasoning=reasoning, content=content)
        finish = output.get("finish_reason") or "stop"
        if auto_called or (required and finish == "stop"):
            finish = "tool_calls"
        choice = ChatCompletionResponseChoice(
            index=int(output.get("index", 0)),
            message=message,
            logprobs=ChatCompletionLogProbs.model_validate(logprobs) if logprobs is not None else None,
            finish_reason=finish,
            stop_reason=output.get("stop_reason"),
            token_ids=token_ids if client.return_token_ids and not suppress else None,
        )
        choices.append(maybe_filter_parallel_tool_calls(choice, client))
    prompt_tokens = len(prompt.token_ids)
    usage = UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        completion_tokens_details=CompletionTokenUsageInfo(reasoning_tokens=total_reasoning)
        if model.include_reasoning_details
        else None,
    )
    response = ChatCompletionResponse(
        id=request.request_id,
        created=int(time.time()),
        model=model.served_name,
        choices=choices,
        usage=usage,
        prompt_token_ids=prompt.token_ids if client.return_token_ids else None,
    )
    return orjson.dumps(response.model_dump(mode="json"))


def _completion_response(model: DerenderModel, request: TokenizedRequest, generate: dict[str, Any]) -> bytes:
    client = model.client_request(request)
    prompt = request.prompts[0]
    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    for output in generate.get("choices") or []:
        token_ids = list(output.get("token_ids") or [])
        completion_tokens += len(token_ids)
        logprobs = None
        if client.logprobs is not None:
            positions = model.logprobs.positions(output.get("logprobs"), [])
            logprobs = completion_logprobs(positions, client.logprobs, 0)
        choices.append(
            {
                "index": len(choices),
                "text": _final_text(model, prompt, prompt.sampling_params, output),
                "logprobs": logprobs,
                "finish_reason": output.get("finish_reason"),
                "stop_reason": output.get("stop_reason"),
                "token_ids": token_ids if client.return_token_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": prompt.token_ids if client.return_token_ids else None,
                "routed_experts": None,
            }
        )
    prompt_tokens = len(prompt.token_ids)
    return orjson.dumps(
        {
            "id": request.request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model.served_name,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    )
