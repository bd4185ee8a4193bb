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
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import orjson

from ext_proc.config import ModelConfig
from ext_proc.derender.logprobs import (
    LogprobDecoder,
    Position,
    Unscored,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_field,
)
from ext_proc.derender.streaming import sse_event
from ext_proc.errors import GatewayError
from ext_proc.extras import PROCESSOR, require
from ext_proc.protocol import ApiFamily, ApiKind, PromptTokens, TokenizedRequest

log = logging.getLogger("tito.derender")


class DerenderModel:
    """What every request of one processor shares: tokenizer, parser class, decoder.

    Loading imports vLLM (and torch): seconds, so it happens once at start-up."""

    def __init__(self, config: ModelConfig, block_size: int = 128) -> None:
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
        self.block_size = block_size  # the engines' KV block size (`pools[].block_size`)

    def prompt_details(self, chat: bool, prompt_tokens: int, cached: int, whole: bool) -> dict[str, Any]:
        """Native's `prompt_tokens_details` (a stream's without its nulls). Generate reports
        only the cached tokens; chat also counts the tokens the prefill wrote to the prefix
        cache: the prompt's full blocks less the cached ones (`PrefillStats.finalize`)."""
        written = prompt_tokens // self.block_size * self.block_size
        details = {
            "cached_tokens": cached,
            "created_cache_tokens": max(0, written - cached) if chat else None,
            "multimodal_tokens": None,
        }
        return details if whole else {k: v for k, v in details.items() if v is not None}

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

    def prompt_logprobs(self, generate: dict[str, Any], prompt: PromptTokens) -> list[Any] | None:
        """A whole answer's `prompt_logprobs` field as native shows it, decoded here (under
        obfuscation the engine's own texts would be of physical ids)."""
        plp = generate.get("prompt_logprobs")
        return None if plp is None else prompt_logprobs_field(self.logprobs.prompt_positions(plp, prompt.token_ids))

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
    prompt_shown: bool = False  # completions: the prompt (echo) or its ids went out

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
        self._prompt_logprobs: list[Any] | None = None  # a whole answer's (the only ones that carry them)
        self.cached_tokens: int | None = None  # the engine's prefix-cache hits, when it reports them
        # A Responses request's steps stay apart: its parser runs on each (`responses.py`)
        self._merges = request.request.family is not ApiFamily.RESPONSES

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
            "model": self._request.request.response_model(self._model.served_name),
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
                merged = _merge(chunks[-1], chunk) if chunks and self._merges else None
                if merged is None:
                    chunks.append(chunk)
                else:
                    chunks[-1] = merged
        return b"".join(sse_event(orjson.dumps(chunk)) for chunk in chunks)

    def _event(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        if event.get("prompt_logprobs") is not None:
            self._prompt_logprobs = event["prompt_logprobs"]
        out = self._prelude()
        for step in _steps(event):
            chunk = self._step(step)
            if chunk is not None:
                out.append(chunk)
        if event.get("usage") is not None and not event.get("choices"):
            self.cached_tokens = cached_tokens(event["usage"])
            if self._include_usage:
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
        self._role = response_role(client)
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
                "delta": {"role": self._role, "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            if self._continuous_usage:
                extra["usage"] = self._usage(0, 0)
            out.append(self._chunk([choice], **extra))
        echoed = echoed_message(self._client, self._role) if self._client.echo else ""
        for i in range(self._n if echoed else 0):  # `echo`: the last message, once per choice
            usage = {"usage": self._usage(0, 0)} if self._continuous_usage else {}
            delta = {"index": i, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None}
            out.append(self._chunk([delta], **usage))
        return out

    def _step(self, step: _Step) -> dict[str, Any] | None:
        choice = self._choice(step.index, parser=True)
        if choice.finished:
            return None
        logprobs = None
        if self._client.logprobs:
            positions = self._logprob_positions(choice, step)
            logprobs = chat_logprobs(
                positions, self._client.top_logprobs, bool(self._client.return_tokens_as_token_ids)
            )
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
            kept = [tc for tc in delta_json.pop("tool_calls") if tc.get("index") == 0]
            if kept:  # native's DeltaMessage leaves an empty list out
                delta_json["tool_calls"] = kept
        extra: dict[str, Any] = {}
        if self._continuous_usage:
            extra["usage"] = self._usage(choice.num_tokens, self._reasoning_tokens(choice))
        return self._chunk([data], **extra)

    def _reasoning_tokens(self, choice: _Choice) -> int:
        if choice.parser is None or not choice.output_ids:
            return 0
        return int(choice.parser.count_reasoning_tokens(tuple(choice.output_ids)))

    def _usage(self, completion_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
        """Native's `UsageInfo` dumped with `exclude_unset`: `completion_tokens_details` is
        always set (null without a reasoning parser), `prompt_tokens_details` only in the
        final usage chunk (`_usage_chunk`)."""
        usage: dict[str, Any] = {
            "prompt_tokens": self._prompt_tokens,
            "total_tokens": self._prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
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
        usage = self._usage(completion, self.reasoning_tokens())
        if self.cached_tokens is not None:  # in native's field order: before the completion's details
            reasoning = usage.pop("completion_tokens_details")
            usage["prompt_tokens_details"] = self._model.prompt_details(
                True, self._prompt_tokens, self.cached_tokens, False
            )
            usage["completion_tokens_details"] = reasoning
        return self._chunk([], usage={k: v for k, v in usage.items() if v is not None})


def cached_tokens(usage: Any) -> int | None:
    """The engine's prefix-cache hits in a generate usage, or None: an engine started
    without `--enable-prompt-tokens-details` reports none (nor does native serving then)."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return None if cached is None else int(cached)


_TEXT_KEYS = frozenset({"content", "reasoning", "text"})
_PER_TOKEN_KEYS = ("logprobs", "token_ids")


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """Two chunks of one choice as one, when only text (content, reasoning, completion text)
    and per-token lists (logprobs, token ids) are in them; None otherwise (tool calls, role,
    finish, usage and prompt ids always keep their own chunk)."""
    if a.keys() != b.keys() or "usage" in a or len(a["choices"]) != 1 or len(b["choices"]) != 1:
        return None
    x, y = a["choices"][0], b["choices"][0]
    if x["index"] != y["index"] or x.get("finish_reason") or y.get("finish_reason") or x.get("prompt_token_ids"):
        return None
    if any((x.get(key) is None) != (y.get(key) is None) for key in _PER_TOKEN_KEYS):
        return None  # (chat's echoed message has no logprobs; the first output's do)
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
        self._prompt_positions: list[Position | Unscored] | None = None

    def _usage(self, completion_tokens: int) -> dict[str, Any]:
        prompt = self._prompt_tokens
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion_tokens,
            "completion_tokens": completion_tokens,
        }

    def _usage_chunk(self) -> dict[str, Any]:
        usage = self._usage(sum(c.num_tokens for c in self._choices.values()))
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = self._model.prompt_details(
                False, self._prompt_tokens, self.cached_tokens, False
            )
        return self._chunk([], usage=usage)

    def _step(self, step: _Step) -> dict[str, Any] | None:
        choice = self._choice(step.index, parser=False)
        text = choice.text(step.token_ids, step.finish_reason, step.stop_reason)
        index = step.index + self._prompt_index * self._n
        echo = self._client.echo and not choice.prompt_shown
        # native: the prompt's ids go with the choice's first output (echo), or its first
        # output at all with `return_token_ids`, even one with nothing to show
        show_prompt = not choice.prompt_shown and (echo or self._client.return_token_ids)
        choice.prompt_shown = choice.prompt_shown or show_prompt
        if not echo and not text and not step.token_ids and not choice.num_tokens:
            return None
        positions = self._logprob_positions(choice, step) if self._client.logprobs is not None else None
        if echo:
            text, positions = self._echoed(text, positions)
        logprobs = None
        if positions is not None:
            as_ids = bool(self._client.return_tokens_as_token_ids)
            logprobs = completion_logprobs(positions, self._client.logprobs, choice.text_offset, as_ids)
            if logprobs["tokens"]:
                choice.text_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        choice.num_tokens += len(step.token_ids)
        data: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": step.finish_reason,
            "stop_reason": step.stop_reason,
            "prompt_token_ids": self._prompt.token_ids if show_prompt else None,
            "token_ids": step.token_ids if self._client.return_token_ids else None,
        }
        extra: dict[str, Any] = {}
        if self._continuous_usage:
            extra["usage"] = self._usage(choice.num_tokens)
        return self._chunk([data], **extra)

    def _echoed(self, text: str, positions: list[Position] | None) -> tuple[str, list[Position | Unscored] | None]:
        """A choice's first output with the prompt before it (`echo`)."""
        if positions is not None and self._prompt_positions is None:  # once for every choice
            self._prompt_positions = _prompt_positions(self._model, self._prompt, self._prompt_logprobs)
        shown = prompt_text(self._model, self._client, self._prompt, self._prompt_index)
        return echoed(shown, self._prompt_positions, text, positions, self._client.max_tokens != 0)


# -- echo and the prompt's logprobs ------------------------------------------------------


def response_role(client: Any) -> str:
    """The answer's role as native chat serving names it (`get_chat_request_role`)."""
    return "assistant" if client.add_generation_prompt else str(client.messages[-1]["role"])


def echoed_message(client: Any, role: str) -> str:
    """Chat `echo`: the last message's content when it has the answer's role (text parts
    joined by newlines, as native's conversation holds them)."""
    last = client.messages[-1] if client.messages else None
    if not last or last.get("role") != role:
        return ""
    content = last.get("content") or ""
    if isinstance(content, str):
        return content
    return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict) and "text" in part)


def prompt_text(model: DerenderModel, client: Any, prompt: PromptTokens, prompt_index: int) -> str:
    """What completions `echo` repeats: the prompt as sent, a token prompt decoded (native:
    the renderer's `_detokenize_prompt`); nothing with `return_token_ids`, whose answer
    carries the prompt's ids instead."""
    if client.return_token_ids:
        return ""
    sent = client.prompt
    if isinstance(sent, str):
        return sent
    if isinstance(sent, list) and sent and all(isinstance(p, str) for p in sent):
        return str(sent[prompt_index])
    return str(model.tokenizer.decode(prompt.token_ids))


def echoed(
    text: str,
    prompt_positions: list[Position | Unscored] | None,
    output_text: str,
    output_positions: Sequence[Position | Unscored] | None,
    generates: bool,
) -> tuple[str, list[Position | Unscored] | None]:
    """Completions `echo`: the prompt (its text and logprobs) before the choice's first output,
    or alone with `max_tokens: 0` (the engine still generated one token; native shows none)."""
    if not generates:
        return text, prompt_positions
    if output_positions is None or prompt_positions is None:
        return text + output_text, None
    return text + output_text, [*prompt_positions, *output_positions]


def _prompt_positions(
    model: DerenderModel, prompt: PromptTokens, prompt_logprobs: list[Any] | None
) -> list[Position | Unscored]:
    if prompt_logprobs is None:
        raise GatewayError(502, "the engine returned no prompt logprobs", code="engine_invalid_response")
    return model.logprobs.prompt_positions(prompt_logprobs, prompt.token_ids)


def stream_session(
    model: DerenderModel, request: TokenizedRequest, prompt_index: int = 0
) -> ChatStream | CompletionStream:
    if request.api is ApiKind.CHAT:
        return ChatStream(model, request, prompt_index)
    return CompletionStream(model, request, prompt_index)


# -- whole (non-streaming) responses --------------------------------------------------------


def derender_whole(
    model: DerenderModel, request: TokenizedRequest, generate: dict[str, Any], prompt_index: int = 0
) -> bytes:
    """One prompt's GenerateResponse -> the OpenAI JSON body native serving returns (one step
    over all ids with the same detokenizer; one `parser.parse` per choice, as natively)."""
    if request.api is ApiKind.CHAT:
        return _chat_response(model, request, generate)
    return _completion_response(model, request, generate, prompt_index)


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
    from vllm.entrypoints.serve.engine.protocol import CompletionTokenUsageInfo, PromptTokenUsageInfo, UsageInfo
    from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls
    from vllm.renderers.chat_utils import make_tool_call_id

    client = model.client_request(request)
    prompt = request.prompts[0]
    role = response_role(client)
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
            logprobs = chat_logprobs(positions, client.top_logprobs, bool(client.return_tokens_as_token_ids))
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
            message = ChatMessage(role=role, reasoning=reasoning, content=content or "", tool_calls=calls)
        elif (
            model.enable_auto_tools and tool_parser and client.tools and client.tool_choice in ("auto", None) and calls
        ):
            auto_called = True
            message = ChatMessage(role=role, reasoning=reasoning, content=content, tool_calls=calls)
        else:
            message = ChatMessage(role=role, reasoning=reasoning, content=content)
        if client.echo:
            message.content = echoed_message(client, role) + (message.content or "")
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
    cached = cached_tokens(generate.get("usage"))
    if cached is not None:
        usage.prompt_tokens_details = PromptTokenUsageInfo(**model.prompt_details(True, prompt_tokens, cached, True))
    response = ChatCompletionResponse(
        id=request.request_id,
        created=int(time.time()),
        model=request.request.response_model(model.served_name),
        choices=choices,
        usage=usage,
        prompt_token_ids=prompt.token_ids if client.return_token_ids else None,
    )
    body = response.model_dump(mode="json")
    body["prompt_logprobs"] = model.prompt_logprobs(generate, prompt)
    return orjson.dumps(body)


def _completion_response(
    model: DerenderModel, request: TokenizedRequest, generate: dict[str, Any], prompt_index: int
) -> bytes:
    client = model.client_request(request)
    prompt = request.prompts[prompt_index]
    prompt_positions = None
    if generate.get("prompt_logprobs") is not None:
        prompt_positions = model.logprobs.prompt_positions(generate["prompt_logprobs"], prompt.token_ids)
    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    for output in generate.get("choices") or []:
        token_ids = list(output.get("token_ids") or [])
        completion_tokens += len(token_ids)
        text = _final_text(model, prompt, prompt.sampling_params, output)
        positions: Sequence[Position | Unscored] | None = None
        if client.logprobs is not None:
            positions = model.logprobs.positions(output.get("logprobs"), [])
        if client.echo:
            if positions is not None and prompt_positions is None:  # the engine sent none: 502
                prompt_positions = _prompt_positions(model, prompt, generate.get("prompt_logprobs"))
            shown = prompt_text(model, client, prompt, prompt_index)
            text, positions = echoed(shown, prompt_positions, text, positions, client.max_tokens != 0)
        as_ids = bool(client.return_tokens_as_token_ids)
        logprobs = None if positions is None else completion_logprobs(positions, client.logprobs, 0, as_ids)
        choices.append(
            {
                "index": len(choices),
                "text": text,
                "logprobs": logprobs,
                "finish_reason": output.get("finish_reason"),
                "stop_reason": output.get("stop_reason"),
                "token_ids": token_ids if client.return_token_ids else None,
                "prompt_logprobs": None if prompt_positions is None else prompt_logprobs_field(prompt_positions),
                "prompt_token_ids": prompt.token_ids if client.return_token_ids else None,
                "routed_experts": None,
            }
        )
    prompt_tokens = len(prompt.token_ids)
    cached = cached_tokens(generate.get("usage"))
    return orjson.dumps(
        {
            "id": request.request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": request.request.response_model(model.served_name),
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens_details": None
                if cached is None
                else model.prompt_details(False, prompt_tokens, cached, True),
                "completion_tokens_details": None,
            },
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    )
