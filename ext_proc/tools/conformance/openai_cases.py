"""The OpenAI conformance cases (chat and completions): each a request, as data, run
streaming and not, with what native's answer must show for the case to prove anything
(those checks are `openai_expects.py`'s)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ext_proc.tools.conformance.core import Expect, Json
from ext_proc.tools.conformance.openai_expects import (
    ALL_REASONING_COUNTED,
    BAD_REQUEST,
    CHAT_NO_TOP,
    CHAT_PROMPT_LOGPROBS,
    CHAT_TOP2,
    COMPLETION_TOKENS_1,
    COMPLETION_TOKENS_16,
    COMPLETION_TOP2,
    HAS_CONTENT,
    HAS_REASONING,
    ID_TOKENS,
    JSON_OBJECT,
    NO_CONTENT,
    NON_ASCII,
    PROMPT_LOGPROBS,
    PROMPT_SCORED,
    SPLIT_CHARS,
    TWO_CHOICES,
    echoes,
    echoes_only,
    finish,
    matches,
    stop_reason,
    tool_arguments,
    tool_names,
    usage_above,
)
from ext_proc.tools.tiny_model import SPECIAL_TOKENS

Api = Literal["chat", "completions"]


@dataclass(frozen=True)
class Spec:
    """One request shape; it runs streaming and non-streaming (`Case`s)."""

    name: str
    api: Api
    body: Mapping[str, Any]  # the request without model and stream
    expect: tuple[Expect, ...]
    stream_usage: bool = False  # streams ask for `stream_options.include_usage`
    streams: tuple[bool, ...] = (False, True)  # the modes the case runs in

    def cases(self) -> list[Case]:
        return [Case(self, stream) for stream in self.streams]


@dataclass(frozen=True)
class Case:
    spec: Spec
    stream: bool

    @property
    def name(self) -> str:
        return f"{self.spec.api}-{self.spec.name}-{'stream' if self.stream else 'full'}"

    @property
    def api(self) -> Api:
        return self.spec.api

    def request(self, model: str) -> Json:
        body: Json = {"model": model, **self.spec.body, "stream": self.stream}
        if self.stream and self.spec.stream_usage:
            body["stream_options"] = {"include_usage": True}
        return body


# Chat without thinking: the prompt closes the think block, so the reasoning parser lets
# structured outputs apply from the first token (with thinking on, vLLM holds them back until
# the model ends its reasoning, which a random-weight model never does).
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
# Completions have no template: the prompt itself closes the think block, for the same reason.
CLOSED_THINK = "</think>\n\n"
# The tiny model's `</think>`: a logit bias makes the model end its reasoning after a few tokens.
THINK_END_ID = SPECIAL_TOKENS.index("</think>")
SAMPLING = {"temperature": 1.0}
WEATHER_TOOL: Json = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "東京 🗼"]}},
            "required": ["city"],
        },
    },
}
# Strict: a named tool_choice then constrains the arguments to the schema (otherwise any JSON,
# which a random model rarely closes). Not for tool_choice=auto, where strictness would replace
# the cases' hermes regex with vLLM's own tool grammar.
STRICT_WEATHER_TOOL: Json = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "東京 🗼"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WORDS_REGEX = r"[a-z]{2,8}( [a-z]{2,8}){2,4}\."
LETTERS_REGEX = "[a-z ]{20,40}"
# Rare characters: not in the tiny tokenizer's vocabulary, so each is split into byte tokens.
RARE_CJK_EMOJI_REGEX = "[鯨鰻齉龘鱈🦑🪐🧭]{4,10}"
ENGLISH = "Tell me a story about a brave little robot."
CJK_EMOJI = "用中文讲个故事 🐉🚀，然后说 こんにちは 👋🏽"


def hermes_tool_call_regex(*cities: str) -> str:
    """A regex for hermes `<tool_call>` blocks (the tiny model's chat template format): with it
    a random-weight model emits exactly these calls, so the tool parser has real work."""
    block = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "CITY"\}\}\n</tool_call>'
    return "\n".join(block.replace("CITY", f"({city})") for city in cities)  # cities: no regex syntax


def _chat(user: str, seed: int, **extra: Any) -> Json:
    return {"messages": [{"role": "user", "content": user}], "seed": seed, **SAMPLING, **extra}


def _constrained_chat(user: str, seed: int, **extra: Any) -> Json:
    return _chat(user, seed, **NO_THINK, **extra)


def _completion(prompt: str, seed: int, **extra: Any) -> Json:
    return {"prompt": prompt, "seed": seed, **SAMPLING, **extra}


def _constrained_completion(prompt: str, seed: int, **extra: Any) -> Json:
    return _completion(prompt + CLOSED_THINK, seed, **extra)


def _regex(regex: str) -> Json:
    return {"structured_outputs": {"regex": regex}}


def _tools(seed: int, *cities: str, **extra: Any) -> Json:
    regex = hermes_tool_call_regex(*cities)
    return _constrained_chat(
        "What is the weather?", seed, tools=[WEATHER_TOOL], max_tokens=80, **_regex(regex), **extra
    )


NAMED_TOOL = {"type": "function", "function": {"name": "get_weather"}}
# No max_tokens: chat's default is the rest of the context (a regex keeps the answer short but
# longer than 16 tokens, so a gateway defaulting to 16 would cut it); completions' default is 16.
LONG_WORDS_REGEX = r"([a-z]{1,5} ){20,24}end\."

# What evaluation harnesses send: lm-eval scores a continuation through an OpenAI endpoint by
# echoing context + continuation with the prompt's logprobs and no new tokens.
LOGLIKELIHOOD = "Question: what is the capital of France?\nAnswer: Paris"
TOKEN_PROMPT = [686, 762, 18, 278, 271]  # the tiny model's ids of "Hello world, this"
# Chat's `echo` repeats the last message when it has the answer's role: a continued answer.
CONTINUED = [{"role": "user", "content": ENGLISH}, {"role": "assistant", "content": "Once upon a time"}]
OUT_OF_VOCABULARY = 999_999  # an id no tokenizer of a test model has: the engine's 400
BEAM = {"use_beam_search": True, "temperature": 0.0}


SPECS: list[Spec] = [
    Spec("content", "chat", _constrained_chat(ENGLISH, 1, max_tokens=24), (HAS_CONTENT, finish("length"))),
    Spec("content", "completions", _completion(ENGLISH, 2, max_tokens=24), (HAS_CONTENT, finish("length"))),
    Spec("reasoning", "chat", _chat(ENGLISH, 143, max_tokens=12), (HAS_REASONING, NO_CONTENT)),
    Spec(
        "reasoning-content",
        "chat",
        _chat("Tell me a story.", 3, max_tokens=24, logit_bias={str(THINK_END_ID): 3.0}),
        (HAS_REASONING, HAS_CONTENT),
    ),
    Spec(
        "tool-auto",
        "chat",
        _tools(5, "Paris", tool_choice="auto"),
        (tool_names(["get_weather"]), finish("tool_calls")),
    ),
    Spec(
        "tool-named",
        "chat",
        _constrained_chat(
            "What is the weather?", 9, tools=[STRICT_WEATHER_TOOL], tool_choice=NAMED_TOOL, max_tokens=60
        ),
        (tool_names(["get_weather"]),),
    ),
    Spec(  # a call cut short by max_tokens: `length`, not `tool_calls`, streamed or not
        "tool-required-cut",
        "chat",
        _constrained_chat("What is the weather?", 9, tools=[STRICT_WEATHER_TOOL], tool_choice="required", max_tokens=6),
        (finish("length"),),
    ),
    Spec(
        "tool-several",
        "chat",
        _tools(7, "Paris", "東京 🗼"),
        (tool_names(["get_weather", "get_weather"]), finish("tool_calls")),
    ),
    Spec("tool-non-ascii", "chat", _tools(8, "東京 🗼"), (tool_arguments({"city": "東京 🗼"}), finish("tool_calls"))),
    Spec(
        "stop",
        "chat",
        _constrained_chat(ENGLISH, 9, max_tokens=40, stop=["e"], **_regex(LETTERS_REGEX)),
        (finish("stop"), stop_reason("e")),
    ),
    Spec(
        "stop",
        "completions",
        _constrained_completion(ENGLISH, 10, max_tokens=40, stop=["e"], **_regex(LETTERS_REGEX)),
        (finish("stop"), stop_reason("e")),
    ),
    Spec(
        "logprobs", "chat", _constrained_chat(ENGLISH, 11, max_tokens=12, logprobs=True, top_logprobs=2), (CHAT_TOP2,)
    ),
    Spec("logprobs", "completions", _completion(ENGLISH, 12, max_tokens=12, logprobs=2), (COMPLETION_TOP2,)),
    Spec(
        "logprobs-as-ids",
        "chat",
        _constrained_chat(CJK_EMOJI, 14, max_tokens=8, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True),
        (CHAT_TOP2, ID_TOKENS),
    ),
    Spec(
        "logprobs-as-ids",
        "completions",
        _completion(CJK_EMOJI, 15, max_tokens=8, logprobs=2, return_tokens_as_token_ids=True),
        (COMPLETION_TOP2, ID_TOKENS),
    ),
    Spec(
        "json",
        "chat",
        _constrained_chat("A city as JSON.", 27, max_tokens=60, structured_outputs={"json": CITY_SCHEMA}),
        (JSON_OBJECT, finish("stop")),
    ),
    Spec(
        "json",
        "completions",
        _constrained_completion("A city as JSON:", 27, max_tokens=60, structured_outputs={"json": CITY_SCHEMA}),
        (JSON_OBJECT, finish("stop")),
    ),
    Spec(
        "regex",
        "chat",
        _constrained_chat(ENGLISH, 15, max_tokens=40, **_regex(WORDS_REGEX)),
        (matches(WORDS_REGEX), finish("stop")),
    ),
    Spec(
        "regex",
        "completions",
        _constrained_completion(ENGLISH, 16, max_tokens=40, **_regex(WORDS_REGEX)),
        (matches(WORDS_REGEX), finish("stop")),
    ),
    Spec("n2", "chat", _constrained_chat(ENGLISH, 17, max_tokens=12, n=2), (TWO_CHOICES,), stream_usage=True),
    Spec("n2", "completions", _completion(ENGLISH, 18, max_tokens=12, n=2), (TWO_CHOICES,), stream_usage=True),
    Spec("usage", "chat", _chat(ENGLISH, 13, max_tokens=12), (ALL_REASONING_COUNTED,), stream_usage=True),
    Spec(
        "usage",
        "completions",
        _completion(ENGLISH, 20, max_tokens=16),
        (usage_above("completion_tokens", 0), usage_above("prompt_tokens", 0)),
        stream_usage=True,
    ),
    Spec(
        "default-max-tokens",
        "chat",
        _constrained_chat(ENGLISH, 21, **_regex(LONG_WORDS_REGEX)),
        (usage_above("completion_tokens", 16), finish("stop")),
        stream_usage=True,
    ),
    Spec(
        "default-max-tokens",
        "completions",
        _completion(ENGLISH, 22),
        (COMPLETION_TOKENS_16, finish("length")),
        stream_usage=True,
    ),
    Spec(
        "cjk-emoji",
        "chat",
        _constrained_chat(CJK_EMOJI, 23, max_tokens=40, **_regex(RARE_CJK_EMOJI_REGEX)),
        (NON_ASCII, SPLIT_CHARS),
        stream_usage=True,
    ),
    Spec(
        "cjk-emoji",
        "completions",
        _constrained_completion(CJK_EMOJI, 24, max_tokens=40, **_regex(RARE_CJK_EMOJI_REGEX)),
        (NON_ASCII, SPLIT_CHARS),
        stream_usage=True,
    ),
    # echo and the prompt's logprobs
    Spec(
        "loglikelihood",
        "completions",
        _completion(LOGLIKELIHOOD, 40, echo=True, logprobs=1, max_tokens=0),
        (echoes_only(LOGLIKELIHOOD), PROMPT_SCORED, COMPLETION_TOKENS_1),
        stream_usage=True,
    ),
    Spec(
        "loglikelihood-1",
        "completions",
        _completion(LOGLIKELIHOOD, 41, echo=True, logprobs=1, max_tokens=1),
        (echoes(LOGLIKELIHOOD), PROMPT_SCORED),
    ),
    Spec(
        "echo-logprobs",
        "completions",
        _completion(CJK_EMOJI, 42, echo=True, logprobs=2, max_tokens=8),
        (echoes(CJK_EMOJI), PROMPT_SCORED),
    ),
    Spec("echo", "completions", _completion(ENGLISH, 43, echo=True, max_tokens=8), (echoes(ENGLISH),)),
    Spec(
        "echo-token-prompt",
        "completions",
        {"prompt": TOKEN_PROMPT, "seed": 44, **SAMPLING, "echo": True, "logprobs": 1, "max_tokens": 4},
        (PROMPT_SCORED,),
    ),
    Spec(
        "echo-batch",
        "completions",
        {"prompt": [ENGLISH, CJK_EMOJI], "seed": 45, **SAMPLING, "echo": True, "logprobs": 1, "max_tokens": 4},
        (PROMPT_SCORED, TWO_CHOICES),
        stream_usage=True,
    ),
    Spec(
        "prompt-logprobs",
        "completions",
        _completion(ENGLISH, 46, prompt_logprobs=2, max_tokens=4),
        (PROMPT_LOGPROBS,),
        streams=(False,),
    ),
    Spec(
        "prompt-logprobs-stream",
        "completions",
        _completion(ENGLISH, 46, prompt_logprobs=2, max_tokens=4),
        (BAD_REQUEST,),
        streams=(True,),
    ),
    Spec(
        "prompt-logprobs",
        "chat",
        _chat(ENGLISH, 47, prompt_logprobs=1, max_tokens=4),
        (CHAT_PROMPT_LOGPROBS,),
        streams=(False,),
    ),
    Spec(
        "echo",
        "chat",
        {
            "messages": CONTINUED,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "seed": 48,
            **SAMPLING,
            **NO_THINK,
            "echo": True,
            "logprobs": True,
            "top_logprobs": 2,
            "max_tokens": 8,
        },
        (echoes("Once upon a time"), CHAT_TOP2),
    ),
    # in-band engine errors: a stream's error event, a whole answer's status and body
    Spec(
        "bad-logit-bias",
        "chat",
        _chat(ENGLISH, 49, max_tokens=4, logit_bias={str(OUT_OF_VOCABULARY): 1.0}),
        (BAD_REQUEST,),
    ),
    Spec(
        "bad-stop-token-ids",
        "completions",
        _completion(ENGLISH, 50, max_tokens=4, stop_token_ids=[OUT_OF_VOCABULARY]),
        (BAD_REQUEST,),
    ),
    # the engine finds it while generating: a stream's only event, not the status
    Spec(
        "bad-prompt-token-ids",
        "completions",
        {**_completion(ENGLISH, 51, max_tokens=4), "prompt": [[1, 2, 3], [OUT_OF_VOCABULARY]]},
        (BAD_REQUEST,),
    ),
    Spec(
        "empty-prompt",
        "completions",
        {**_completion(ENGLISH, 52, max_tokens=4), "prompt": ["", ENGLISH]},
        (BAD_REQUEST,),
    ),
    # Beam search (`legs/beam.py`): native's API server and the gateway each run vLLM's search
    # over one-token engine steps. Greedy: each step's candidates are then the top 2n alone
    # (sampled, a step also offers its random sample, and a sampled EOS completes a beam:
    # native's own answer then varies from run to run).
    Spec("beam-search", "chat", _constrained_chat(ENGLISH, 60, max_tokens=8, **BEAM, n=2), (TWO_CHOICES,)),
    Spec("beam-search-reasoning", "chat", _chat(ENGLISH, 61, max_tokens=6, **BEAM), (HAS_REASONING,)),
    Spec(  # native refuses a streamed one (tests/e2e/test_bad_inputs.py)
        "beam-search",
        "completions",
        _completion(ENGLISH, 62, max_tokens=8, **BEAM, n=3, length_penalty=0.5),
        (HAS_CONTENT,),
        streams=(False,),
    ),
    Spec(
        "beam-search-logprobs",
        "chat",
        _constrained_chat(ENGLISH, 64, max_tokens=6, **BEAM, n=2, logprobs=True) | {"top_logprobs": 2},
        (CHAT_TOP2,),
    ),
    Spec(
        "beam-search-logprobs",
        "completions",
        _completion(CJK_EMOJI, 65, max_tokens=6, **BEAM, n=2, logprobs=2),
        (COMPLETION_TOP2,),
        streams=(False,),
    ),
    Spec(
        "beam-search-batch",
        "completions",
        {**_completion(ENGLISH, 63, max_tokens=5, **BEAM, n=2), "prompt": [ENGLISH, CJK_EMOJI]},
        (HAS_CONTENT,),
        streams=(False,),
    ),
    # `top_logprobs` unset: the sampled tokens' logprobs alone (generate still keeps one candidate)
    Spec("logprobs-no-top", "chat", _constrained_chat(ENGLISH, 13, max_tokens=8, logprobs=True), (CHAT_NO_TOP,)),
]
CASES: list[Case] = [case for spec in SPECS for case in spec.cases()]
