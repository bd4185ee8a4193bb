"""Fuzz: the in-process streaming derender says what vLLM's own serving says, on thousands of
random outputs.

`ext_proc/derender/in_process.py` claims that a client streaming through the gateway sees what
the engine's own OpenAI endpoint would send. The hand-written cases of
`test_derender_in_process.py` pin the known shapes; this module checks the claim where the hard
cases live, on seeded random output id sequences (1-60 ids; 4000 chat, 2000 completions):
byte-fallback ids that end in incomplete UTF-8, special tokens (`<think>`, `</think>`,
`<tool_call>`, `</tool_call>`, ...) in the middle of text, well-formed and broken hermes tool
calls, reasoning after thinking and non-thinking prompts, EOS, stop-token and length endings,
stop strings, n > 1, engine steps of several ids (speculative decoding), and the output
collector merging steps the client had not read yet (backpressure). The parsers are qwen3
(reasoning) and hermes (tools), tools are offered or not, `tool_choice` varies.

The reference is vLLM's own code path, not re-implemented logic:
- the request is validated into vLLM's protocol model, adjusted by the parser as the renderer
  does (`adjust_request`: hermes turns `skip_special_tokens` off), and gives its own
  `to_sampling_params`;
- each engine step is an `EngineCoreOutput` through the engine's `OutputProcessor` (its
  `IncrementalDetokenizer`, stop string detection and trimming, `RequestOutput`s, child
  requests for n > 1 as `AsyncLLM` makes them) into its `RequestOutputCollector`;
- the `RequestOutput`s the client reads drive `OpenAIServingChat.chat_completion_stream_generator`
  (the serving class built with `reasoning_parser="qwen3"`, `tool_parser="hermes"`) or
  `OpenAIServingCompletion.completion_stream_generator`.

The gateway gets the same `RequestOutput`s as the tokens-out generate endpoint streams them
(per choice: ids, finish and stop reasons, no text), with the sampling params serialized in a
`GenerateRequest` as the render sidecar sends them, grouped at random into
`stream_session(...).steps` calls. Chunks of one call may merge, so per choice the client's
view is compared: accumulated content, reasoning and completion text, tool calls (name,
concatenated arguments, count, an id that is sent and never changes), finish and stop reasons,
usage. When every call gets one event, nothing merges and the chunks themselves are compared,
all but `created` and tool call ids (`_wire`): `system_fingerprint` too, which native stamps
on each choice's last chunk or on the usage chunk, and the gateway with the engines' own (here
one set on both). Any difference fails with the case (body, prompt, steps, seeds) and both views.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import orjson
import pytest

from ext_proc.protocol import OpenAIRequest, Pipeline, PromptTokens, TokenizedRequest

if TYPE_CHECKING:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import SamplingParams

    from ext_proc.derender.model import DerenderModel

SEED = 20260
CHAT_SEQUENCES = 4000
COMPLETION_SEQUENCES = 2000
MAX_IDS = 60

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
]
HEADER = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
PROMPT_SUFFIXES = ["", "<think>\n", "<think>\n\n</think>\n\n"]
STOP_TOKEN = "<|endoftext|>"  # sometimes a stop token id (`stop_token_ids`) ends generation, not EOS
MID_TEXT_SPECIALS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_start|>", "<|endoftext|>"]
TEXTS = [
    "hello 世界 🐉🚀",
    "The quick brown fox jumps over the lazy dog.",
    "東京は晴れです。",
    "naïve café résumé über straße",
    "😀 🚀 🎉 👍🏽 🇫🇷 ❤️ 🤖",
    "What is 2 + 2? The answer is 4.",
    "def add(a, b):\n    return a + b\n",
    "안녕하세요",
    " ",
    "\n",
    "\n\n",
    "{",
    '"}',
]
TOOL_TEXTS = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京 🗼", "unit": "celsius"}}\n</tool_call>',
    '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "search", "arguments": {"query": "vLLM 🚀"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
    '<tool_call>\n{"name": ',
    "<tool_call>\nnot json at all\n</tool_call>",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
]


# -- the tokenizer and both sides, built once ------------------------------------------------


@dataclass
class _Vocab:
    eos: int
    special: dict[str, int]
    plain: list[int]  # every non-special id
    fallback: list[int]  # ids that decode alone to incomplete UTF-8 (ends with U+FFFD)
    fallback_set: frozenset[int] = frozenset()


@dataclass
class _Env:
    model: DerenderModel  # the gateway's
    tokenizer: Any
    vocab: _Vocab
    chat: OpenAIServingChat  # native
    completion: OpenAIServingCompletion  # native
    loop: asyncio.AbstractEventLoop
    encoded: dict[str, list[int]] = field(default_factory=dict)

    def encode(self, text: str) -> list[int]:
        ids = self.encoded.get(text)
        if ids is None:
            ids = self.encoded[text] = [int(t) for t in self.tokenizer.encode(text)]
        return ids


FINGERPRINT = "vllm-0.32.0-0123abcd"


@pytest.fixture(scope="module")
def env(derender_model: Any) -> Iterator[_Env]:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    from ext_proc.tools.tiny_model import SPECIAL_TOKENS, ensure_tiny_model

    path = str(ensure_tiny_model(Path("~/.cache/tito").expanduser()))
    model = derender_model
    tokenizer = model.tokenizer
    special = {t: int(tokenizer.convert_tokens_to_ids(t)) for t in SPECIAL_TOKENS}
    plain = [i for i in range(len(tokenizer)) if i not in special.values()]
    fallback = [i for i in plain if tokenizer.decode([i]).endswith("\ufffd")]
    assert fallback, "the tiny tokenizer has no byte-fallback ids: the fuzz would miss incomplete UTF-8"
    vocab = _Vocab(int(tokenizer.eos_token_id), special, plain, fallback, frozenset(fallback))

    # What the serving classes read of the engine: the model config and the tokenizer.
    model_config = SimpleNamespace(
        model=path,
        hf_config=SimpleNamespace(model_type="qwen3"),
        max_model_len=4096,
        generation_config="vllm",
        override_generation_config={},
        get_diff_sampling_param=dict,
    )
    engine = SimpleNamespace(
        model_config=model_config,
        renderer=SimpleNamespace(tokenizer=tokenizer),
        input_processor=None,
        vllm_config=None,
    )
    chat = OpenAIServingChat(
        engine,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        "assistant",
        online_renderer=None,  # type: ignore[arg-type]
        request_logger=None,
        chat_template=None,
        chat_template_content_format="auto",
        reasoning_parser="qwen3",
        enable_auto_tools=True,
        tool_parser="hermes",
    )
    completion = OpenAIServingCompletion(
        engine,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        online_renderer=None,  # type: ignore[arg-type]
        request_logger=None,
    )
    # The engines' fingerprint, as the gateway learns it from their capability probe
    chat.system_fingerprint = completion.system_fingerprint = FINGERPRINT
    unknown, model.system_fingerprint = model.system_fingerprint, lambda: FINGERPRINT
    loop = asyncio.new_event_loop()
    try:
        yield _Env(model, tokenizer, vocab, chat, completion, loop)
    finally:
        loop.close()
        model.system_fingerprint = unknown


# -- one random case ---------------------------------------------------------------------------


@dataclass
class _Output:
    """One choice's output as the engine core sends it: steps of new ids, the last one ending
    generation (unless a stop string ends it earlier)."""

    steps: list[list[int]]
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    stop_reason: int | None  # the stop token id, or None for EOS and length


@dataclass
class _Case:
    api: Pipeline
    body: dict[str, Any]
    prompt_ids: list[int]
    outputs: list[_Output]  # one per choice (n)
    engine_seed: int  # the order of choices within an engine step, and when the client reads
    grouping: list[int] = field(default_factory=list)  # generate events per `steps` call

    def describe(self) -> str:
        data = {
            "api": self.api.value,
            "body": self.body,
            "prompt_ids": self.prompt_ids,
            "outputs": [vars(o) for o in self.outputs],
            "engine_seed": self.engine_seed,
            "grouping": self.grouping,
        }
        return _json(data)


def _piece(rng: random.Random, env: _Env, thinking_prompt: bool) -> list[int]:
    """A few output ids of one kind."""
    vocab = env.vocab
    kind = rng.random()
    if kind < 0.2:
        return [rng.choice(vocab.plain) for _ in range(rng.randint(1, 6))]
    if kind < 0.35:
        return [rng.choice(vocab.fallback) for _ in range(rng.randint(1, 4))]
    if kind < 0.55:
        weighted = MID_TEXT_SPECIALS[:4] * 3 + MID_TEXT_SPECIALS[4:]  # mostly the parsers' markers
        return [vocab.special[rng.choice(weighted)]]
    if kind < 0.75:
        return env.encode(rng.choice(TEXTS))
    if kind < 0.88:
        return env.encode(rng.choice(TOOL_TEXTS))
    thought = rng.choice(TEXTS)
    opened = thinking_prompt and rng.random() < 0.7
    return env.encode(("" if opened else "<think>\n") + thought + "\n</think>\n\n" + rng.choice(TEXTS))


def _output(rng: random.Random, env: _Env, thinking_prompt: bool) -> _Output:
    body: list[int] = []
    for _ in range(rng.randint(1, 6)):
        body += _piece(rng, env, thinking_prompt)
    ending = rng.random()
    if ending < 0.55:  # EOS: sent by the engine core, stop-terminated, never shown
        ids, finish, stop_reason = body[: rng.randint(0, MAX_IDS - 1)] + [env.vocab.eos], "stop", None
    elif ending < 0.65:  # a stop token id: the same, with the id as stop_reason
        stop_id = env.vocab.special[STOP_TOKEN]
        ids, finish, stop_reason = body[: rng.randint(0, MAX_IDS - 1)] + [stop_id], "stop", stop_id
    else:
        ids, finish, stop_reason = body[: rng.randint(1, MAX_IDS)], "length", None
    # Engine steps: mostly one id each; in some requests several (speculative decoding).
    steps, i = [], 0
    multi = rng.random() < 0.4
    while i < len(ids):
        size = rng.randint(2, 4) if multi and rng.random() < 0.5 else 1
        steps.append(ids[i : i + size])
        i += size
    return _Output(steps, finish, stop_reason)


def _stop_strings(rng: random.Random, env: _Env, output: _Output) -> list[str]:
    """Usually a piece of the output text itself, so that the stop string is really hit."""
    ids = [t for step in output.steps for t in step]
    text = env.tokenizer.decode(ids, skip_special_tokens=False).replace("\ufffd", "")
    if text and rng.random() < 0.8:
        start = rng.randrange(len(text))
        return [text[start : start + rng.randint(1, 6)]]
    return [rng.choice(["STOP", "}", "\n", "世界"])]


def _common_options(rng: random.Random, env: _Env, body: dict[str, Any], outputs: list[_Output]) -> None:
    if len(outputs) > 1:
        body["n"] = len(outputs)
    if any(o.stop_reason is not None for o in outputs):
        body["stop_token_ids"] = [env.vocab.special[STOP_TOKEN]]
    special = rng.random()
    if special < 0.15:
        body["skip_special_tokens"] = False
    elif special < 0.25:
        body["skip_special_tokens"] = True
    if rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.5}


def _choices(rng: random.Random) -> int:
    return 1 if rng.random() < 0.8 else rng.randint(2, 3)


def _chat_case(rng: random.Random, env: _Env) -> _Case:
    suffix = rng.choice(PROMPT_SUFFIXES)
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    thinking = rng.random()
    if thinking < 0.3:
        body["chat_template_kwargs"] = {"enable_thinking": False}
        suffix = "<think>\n\n</think>\n\n" if rng.random() < 0.8 else suffix
    elif thinking < 0.5:
        body["chat_template_kwargs"] = {"enable_thinking": True}
    if rng.random() < 0.55:
        body["tools"] = TOOLS
        choice = rng.random()
        if choice < 0.45:
            body["tool_choice"] = "auto"
        elif choice < 0.55:
            body["tool_choice"] = "none"
        elif choice < 0.65:
            body["tool_choice"] = "required"
        elif choice < 0.75:
            body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
        if rng.random() < 0.1:
            body["parallel_tool_calls"] = False
    if rng.random() < 0.1:
        body["include_reasoning"] = False
    outputs = [_output(rng, env, suffix == "<think>\n") for _ in range(_choices(rng))]
    if rng.random() < 0.1:
        body["stop"] = _stop_strings(rng, env, outputs[0])
    _common_options(rng, env, body, outputs)
    return _Case(Pipeline.CHAT, body, env.encode(HEADER + suffix), outputs, rng.randrange(2**32))


def _completion_case(rng: random.Random, env: _Env) -> _Case:
    body: dict[str, Any] = {"model": "tiny", "prompt": "hi", "stream": True, "max_tokens": MAX_IDS + 1}
    outputs = [_output(rng, env, False) for _ in range(_choices(rng))]
    if rng.random() < 0.4:
        body["stop"] = _stop_strings(rng, env, outputs[0])
        if rng.random() < 0.25:
            body["include_stop_str_in_output"] = True
        if rng.random() < 0.15:
            body["min_tokens"] = rng.randint(1, 8)
    _common_options(rng, env, body, outputs)
    prompt = HEADER if rng.random() < 0.5 else "hi"
    return _Case(Pipeline.COMPLETIONS, body, env.encode(prompt), outputs, rng.randrange(2**32))


# -- native: vLLM's output processor and serving generators -----------------------------------


def _native_request(env: _Env, case: _Case) -> tuple[ChatCompletionRequest | CompletionRequest, SamplingParams]:
    """The client request as native serving holds it (validated, adjusted by the parser) and
    the sampling params it gives the engine."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    if case.api is Pipeline.COMPLETIONS:
        completion = CompletionRequest.model_validate(case.body)
        return completion, _delta(completion.to_sampling_params(MAX_IDS + 1, {}))
    chat = ChatCompletionRequest.model_validate(case.body)
    kwargs = env.chat._effective_chat_template_kwargs(chat)
    # The renderer adjusts whenever a reasoning parser is configured (qwen3 here), with a
    # parser made as serving makes its own.
    adjusted = env.chat._make_parser(chat, env.tokenizer, kwargs).adjust_request(request=chat)
    assert isinstance(adjusted, ChatCompletionRequest)
    return adjusted, _delta(adjusted.to_sampling_params(MAX_IDS + 1, {}))


def _delta(params: SamplingParams) -> SamplingParams:
    from vllm.sampling_params import RequestOutputKind

    assert params.output_kind == RequestOutputKind.DELTA  # streaming requests
    return params


def _request_outputs(env: _Env, case: _Case, params: SamplingParams) -> list[RequestOutput]:
    """What `AsyncLLM.generate` yields for the engine core's steps: the output processor
    detokenizes each step (and finds stop strings), its collector merges what the client has
    not read yet (backpressure), fanned out to child requests for n > 1 as `AsyncLLM` does."""
    from vllm.outputs import RequestOutput
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.v1.engine.parallel_sampling import ParentRequest

    rng = random.Random(case.engine_seed)
    request_id = "fuzz"
    processor = OutputProcessor(env.tokenizer, log_stats=False)
    queue = RequestOutputCollector(params.output_kind, request_id)
    prompt = env.tokenizer.decode(case.prompt_ids)

    def engine_request(child_id: str, child_params: SamplingParams) -> EngineCoreRequest:
        return EngineCoreRequest(
            request_id=child_id,
            prompt_token_ids=case.prompt_ids,
            mm_features=None,
            sampling_params=child_params,
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            external_req_id=request_id,
        )

    parent_request = engine_request(request_id, params)
    child_ids = [request_id]
    if params.n == 1:
        processor.add_request(parent_request, prompt, None, 0, queue)
    else:
        parent = ParentRequest(parent_request)
        child_ids = []
        for index in range(params.n):
            child_id, child_params = parent.get_child_info(index)
            processor.add_request(engine_request(child_id, child_params), prompt, parent, index, queue)
            child_ids.append(child_id)

    pending = {child_ids[i]: list(o.steps) for i, o in enumerate(case.outputs)}
    endings = {child_ids[i]: o for i, o in enumerate(case.outputs)}
    backpressure = rng.random() < 0.3
    outputs: list[RequestOutput] = []
    while pending:
        step = []
        for child_id in rng.sample(sorted(pending), len(pending)):
            ids = pending[child_id].pop(0)
            last = not pending[child_id]
            ending = endings[child_id]
            step.append(
                EngineCoreOutput(
                    request_id=child_id,
                    new_token_ids=list(ids),
                    finish_reason=(FinishReason.STOP if ending.finish_reason == "stop" else FinishReason.LENGTH)
                    if last
                    else None,
                    stop_reason=ending.stop_reason if last else None,
                )
            )
            if last:
                del pending[child_id]
        for child_id in processor.process_outputs(step).reqs_to_abort:  # a stop string ended it
            pending.pop(child_id, None)
        if not backpressure or rng.random() < 0.4 or not pending:
            output = queue.get_nowait()
            if output is not None:
                assert isinstance(output, RequestOutput)
                outputs.append(output)
    assert not processor.has_unfinished_requests()
    return outputs


async def _collect(stream: AsyncIterator[str]) -> list[str]:
    return [item async for item in stream]


async def _replay(outputs: list[RequestOutput]) -> AsyncIterator[RequestOutput]:
    for output in outputs:
        yield output


async def _replay_indexed(outputs: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    for output in outputs:
        yield 0, output


def _native(
    env: _Env, case: _Case, request: ChatCompletionRequest | CompletionRequest, outputs: list[RequestOutput]
) -> list[dict[str, Any]]:
    from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request_id = _request_id(case)
    metadata = RequestResponseMetadata(request_id=request_id)
    stream: AsyncIterator[str]
    if isinstance(request, ChatCompletionRequest):
        stream = env.chat.chat_completion_stream_generator(
            request,
            _replay(outputs),
            request_id,
            "tiny",
            [],
            env.tokenizer,
            metadata,
            chat_template_kwargs=env.chat._effective_chat_template_kwargs(request),
        )
    else:
        stream = env.completion.completion_stream_generator(
            request, [], _replay_indexed(outputs), request_id, 0, "tiny", 1, env.tokenizer, metadata
        )
    raw = env.loop.run_until_complete(_collect(stream))
    assert raw[-1] == "data: [DONE]\n\n"
    return [orjson.loads(item.removeprefix("data: ")) for item in raw[:-1]]


def _request_id(case: _Case) -> str:
    return "chatcmpl-fuzz" if case.api is Pipeline.CHAT else "cmpl-fuzz"


# -- the gateway: generate events through `stream_session` ------------------------------------


def _events(outputs: list[RequestOutput], include_usage: bool, prompt_tokens: int) -> list[dict[str, Any]]:
    """The tokens-out generate endpoint's stream of the same `RequestOutput`s: an event per
    choice with new ids or a finish (ids and reasons, no text), then the usage event."""
    events: list[dict[str, Any]] = []
    generated = 0
    for res in outputs:
        for out in res.outputs:
            generated += len(out.token_ids)
            if not out.token_ids and out.finish_reason is None:
                continue
            choice = {
                "index": out.index,
                "token_ids": list(out.token_ids),
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            events.append({"choices": [choice]})
    if include_usage:
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": generated}
        events.append({"choices": [], "usage": {**usage, "total_tokens": prompt_tokens + generated}})
    return events


def _coalesced(events: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The same output as an engine asked for `stream_interval: k` sends it: per choice its
    first token alone, then k at a time, the finish with the last (the usage event last)."""
    groups: dict[int, list[list[dict[str, Any]]]] = {}
    for event in events:
        for choice in event["choices"]:
            runs = groups.setdefault(choice["index"], [])
            if len(runs) < 2 or sum(len(c["token_ids"]) for c in runs[-1]) >= k:
                runs.append([])
            runs[-1].append(choice)
    merged = [
        {"choices": [{**run[-1], "token_ids": [t for c in run for t in c["token_ids"]]}]}
        for runs in groups.values()
        for run in runs
        if run
    ]
    return merged + [e for e in events if not e["choices"]]


def _gateway(
    env: _Env, case: _Case, params: SamplingParams, events: list[dict[str, Any]], per_token: bool = False
) -> list[dict[str, Any]]:
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    from ext_proc.derender.in_process import stream_session
    from ext_proc.derender.pipeline import per_token as split

    request_id = _request_id(case)
    # The render sidecar's answer, serialized as it goes over the wire.
    rendered = GenerateRequest(
        request_id=request_id, token_ids=case.prompt_ids, sampling_params=params, stream=True
    ).model_dump(mode="json")
    request = TokenizedRequest(OpenAIRequest(case.api, case.body), request_id, [PromptTokens.rendered(rendered)])
    session = stream_session(env.model, request)

    def steps(group: list[dict[str, Any]]) -> bytes:
        if per_token:  # `pipeline.PerTokenSteps`: one token per parser step
            group = [piece for event in group for piece in split(event) or [event]]
        return bytes(session.steps(group))

    raw, start = b"", 0
    for size in case.grouping:
        raw += steps(events[start : start + size])
        start += size
    raw += steps(events[start:])
    return [orjson.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n") if e]


def _grouping(rng: random.Random, count: int) -> list[int]:
    """How many events arrive together, per `steps` call; in some requests always one (then
    no chunks merge, and the chunks themselves are compared)."""
    if rng.random() < 0.3:
        return [1] * count
    sizes = []
    while count > 0:
        size = min(count, rng.randint(1, 6))
        sizes.append(size)
        count -= size
    return sizes


# -- comparison ------------------------------------------------------------------------------


@dataclass
class _ToolCall:
    name: str = ""
    arguments: str = ""
    ids: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        # Ids are random per call; what must hold is that one is sent, and never changes.
        return {
            "name": self.name,
            "arguments": self.arguments,
            "has_id": bool(self.ids),
            "stable_id": len(set(self.ids)) <= 1,
        }


def _summary(api: Pipeline, chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per choice: what a client assembles from the stream."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        if "error" in chunk or "choices" not in chunk:
            raise AssertionError(f"error chunk: {chunk}")
        if chunk.get("usage") is not None and not chunk["choices"]:
            usage = chunk["usage"]
        for c in chunk["choices"]:
            s = choices.setdefault(
                c["index"],
                {
                    "role": None,
                    "content": "",
                    "reasoning": "",
                    "text": "",
                    "tools": {},
                    "finish": [],
                    "stop_reason": None,
                    "finish_usage": None,
                },
            )
            if c.get("finish_reason") is not None:
                s["finish"].append(c["finish_reason"])
                s["stop_reason"] = c.get("stop_reason")
                s["finish_usage"] = chunk.get("usage")  # continuous usage stats
            if api is Pipeline.COMPLETIONS:
                s["text"] += c.get("text") or ""
                continue
            delta = c.get("delta") or {}
            s["role"] = s["role"] or delta.get("role")
            s["content"] += delta.get("content") or ""
            s["reasoning"] += delta.get("reasoning") or ""
            for tc in delta.get("tool_calls") or []:
                call = s["tools"].setdefault(tc["index"], _ToolCall())
                if tc.get("id"):
                    call.ids.append(tc["id"])
                function = tc.get("function") or {}
                call.name += function.get("name") or ""
                call.arguments += function.get("arguments") or ""
    for s in choices.values():
        s["tools"] = {i: call.summary() for i, call in sorted(s["tools"].items())}
    return {"choices": choices, "usage": usage}


def _json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


def _wire(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chunks as compared one by one: all but the creation time and the (random) tool call ids."""
    out = []
    for chunk in chunks:
        chunk = {k: v for k, v in chunk.items() if k != "created"}
        choices = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta")
            if delta is not None and "tool_calls" in delta:
                calls = [{**tc, "id": bool(tc.get("id"))} for tc in delta["tool_calls"]]
                choice = {**choice, "delta": {**delta, "tool_calls": calls}}
            choices.append(choice)
        out.append({**chunk, "choices": choices})
    return out


def _coverage(api: Pipeline, env: _Env, case: _Case, events: list[dict[str, Any]], native: dict[str, Any]) -> set[str]:
    """What this case exercised (so that the generator cannot silently stop making the hard
    cases)."""
    ids = [t for o in case.outputs for t in [t for step in o.steps for t in step][:-1]]  # all but the last
    specials = set(env.vocab.special.values())
    hit = {
        "byte-fallback ids": any(t in env.vocab.fallback_set for t in ids),
        "special tokens mid-text": any(t in specials for t in ids),
        "stop strings hit": any(isinstance(c["stop_reason"], str) for c in native["choices"].values()),
        "multi-id events": any(len(c["token_ids"]) > 1 for e in events for c in e["choices"]),
        "n > 1": len(case.outputs) > 1,
        "chunks compared exactly": all(size == 1 for size in case.grouping),
        "length": any(o.finish_reason == "length" for o in case.outputs),
    }
    if api is Pipeline.CHAT:
        hit["tool calls"] = any(c["tools"] for c in native["choices"].values())
        hit["reasoning"] = any(c["reasoning"] for c in native["choices"].values())
        hit["content"] = any(c["content"] for c in native["choices"].values())
    return {name for name, yes in hit.items() if yes}


def _fuzz(env: _Env, api: Pipeline, count: int, seed: int) -> None:
    rng = random.Random(seed)
    failures: list[str] = []
    covered: dict[str, int] = {}
    for n in range(count):
        case = _chat_case(rng, env) if api is Pipeline.CHAT else _completion_case(rng, env)
        request, params = _native_request(env, case)
        outputs = _request_outputs(env, case, params)
        include_usage = bool((case.body.get("stream_options") or {}).get("include_usage"))
        events = _events(outputs, include_usage, len(case.prompt_ids))
        case.grouping = _grouping(rng, len(events))
        try:
            native_chunks = _native(env, case, request, outputs)
            gateway_chunks = _gateway(env, case, params, events)
            native, gateway = _summary(api, native_chunks), _summary(api, gateway_chunks)
        except Exception as e:  # an error chunk, or the gateway raised: this case fails
            failures.append(f"case {n}: {case.describe()}\n  {e!r}")
            continue
        if native != gateway:
            failures.append(f"case {n}: {case.describe()}\n  native:  {_json(native)}\n  gateway: {_json(gateway)}")
        elif all(size == 1 for size in case.grouping) and _wire(native_chunks) != _wire(gateway_chunks):
            failures.append(
                f"case {n}, chunk by chunk: {case.describe()}\n  native:  {_json(_wire(native_chunks))}\n"
                f"  gateway: {_json(_wire(gateway_chunks))}"
            )
        for name in _coverage(api, env, case, events, native):
            covered[name] = covered.get(name, 0) + 1
    assert not failures, f"{len(failures)}/{count} {api.value} sequences differ (seed {seed}); first:\n{failures[0]}"
    kinds = 10 if api is Pipeline.CHAT else 7
    assert len(covered) == kinds and min(covered.values()) >= count // 50, f"too little covered: {covered}"
    print(f"{api.value}: {count} sequences, 0 differences; covered {covered}")


def _fuzz_coalesced(env: _Env, api: Pipeline, count: int, seed: int) -> None:
    """Native one token per step; the gateway gets the same output k tokens per event
    (`derender.stream_interval`) and splits them back into steps: the same answer."""
    rng = random.Random(seed)
    failures: list[str] = []
    tested = 0
    for n in range(count):
        case = _chat_case(rng, env) if api is Pipeline.CHAT else _completion_case(rng, env)
        k = rng.choice([2, 4, 16])
        request, params = _native_request(env, case)
        outputs = _request_outputs(env, case, params)
        if any(len(out.token_ids) > 1 for res in outputs for out in res.outputs):
            continue  # native's own steps must be single tokens here (no engine or collector merging)
        include_usage = bool((case.body.get("stream_options") or {}).get("include_usage"))
        events = _coalesced(_events(outputs, include_usage, len(case.prompt_ids)), k)
        case.grouping = _grouping(rng, len(events))
        tested += 1
        try:
            native = _summary(api, _native(env, case, request, outputs))
            gateway = _summary(api, _gateway(env, case, params, events, per_token=True))
        except Exception as e:
            failures.append(f"case {n} (k={k}): {case.describe()}\n  {e!r}")
            continue
        if native != gateway:
            failures.append(
                f"case {n} (k={k}): {case.describe()}\n  native:  {_json(native)}\n  gateway: {_json(gateway)}"
            )
    assert not failures, f"{len(failures)}/{tested} coalesced {api.value} sequences differ; first:\n{failures[0]}"
    assert tested >= count // 5, f"only {tested} of {count} cases had single-token steps"


def test_chat_stream_equals_native_serving(env: _Env) -> None:
    _fuzz(env, Pipeline.CHAT, CHAT_SEQUENCES, SEED)


def test_completion_stream_equals_native_serving(env: _Env) -> None:
    _fuzz(env, Pipeline.COMPLETIONS, COMPLETION_SEQUENCES, SEED + 1)


def test_k_tokens_per_engine_event_split_back_equal_native_one_per_step(env: _Env) -> None:
    _fuzz_coalesced(env, Pipeline.CHAT, CHAT_SEQUENCES // 2, SEED + 2)
    _fuzz_coalesced(env, Pipeline.COMPLETIONS, COMPLETION_SEQUENCES // 2, SEED + 3)
