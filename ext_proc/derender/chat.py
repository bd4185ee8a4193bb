"""Chat answers as `OpenAIServingChat` (0.32) makes them: the stream, chunk by chunk, and the
whole answer; `echo` repeats the last message."""

from __future__ import annotations

import time
from typing import Any

import orjson

from ext_proc.derender.logprobs import (
    chat_logprobs,
    detokenized,
)
from ext_proc.derender.model import DerenderModel, cached_tokens
from ext_proc.derender.session import Choice, Session, Step, delta_fields, final_text
from ext_proc.protocol import TokenizedRequest


class ChatStream(Session):
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

    def _step(self, step: Step) -> dict[str, Any] | None:
        choice = self._choice(step.index, parser=True)
        if choice.finished:
            return None
        logprobs = None
        if self._client.logprobs:
            positions = self._logprob_positions(choice, step)
            logprobs = chat_logprobs(
                positions, self._client.top_logprobs, bool(self._client.return_tokens_as_token_ids)
            )
        text = choice.text(step)
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
            delta_json = delta_fields(delta)
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

    def _reasoning_tokens(self, choice: Choice) -> int:
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


def chat_response(model: DerenderModel, request: TokenizedRequest, generate: dict[str, Any]) -> bytes:
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
        text = final_text(model, prompt, prompt.sampling_params, output)
        logprobs = None
        if client.logprobs:
            positions = model.logprobs.positions(output.get("logprobs"), [], detokenized(prompt.sampling_params))
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
        system_fingerprint=model.system_fingerprint(),
        usage=usage,
        prompt_token_ids=prompt.token_ids if client.return_token_ids else None,
    )
    body = response.model_dump(mode="json")
    body["prompt_logprobs"] = model.prompt_logprobs(generate, prompt)
    return orjson.dumps(body)
