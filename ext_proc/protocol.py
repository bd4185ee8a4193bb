"""Gateway-side protocol models: what the processor knows about one OpenAI request.

Wire bodies of vLLM (GenerateRequest, generate chunks, derender requests) stay as the JSON
they are on the wire; these models only carry what the gateway itself reasons about.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

GENERATE_PATH = "/inference/v1/generate"
DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default, omitted from render output when equal


class ApiKind(enum.Enum):
    """An OpenAI API the gateway renders (Anthropic Messages are chat inside the gateway,
    OpenAI Responses are rendered as such and completions inside); anything else goes to the
    engine untouched."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"

    @property
    def render_path(self) -> str:
        return self.value + "/render"

    @property
    def derender_path(self) -> str:
        return self.value + "/derender"

    @property
    def client_request_key(self) -> str:
        """Where derender expects the original client request."""
        return "chat_request" if self is ApiKind.CHAT else "completion_request"

    @classmethod
    def from_handler(cls, handler: str) -> ApiKind | None:
        """The API of a public route's handler (`listener.routes`), if tito renders it."""
        chat, completions = cls.CHAT, cls.COMPLETIONS
        return {
            "chat": chat,
            "completions": completions,
            "messages": chat,
            "messages_count_tokens": chat,
            "responses": cls.RESPONSES,
        }.get(handler)


class ApiFamily(enum.Enum):
    """The API the client speaks. Anthropic Messages requests are chat requests inside the
    gateway (as in native vLLM): converted at the door, their answers converted on the way
    out (`frontend/anthropic_messages.py`). OpenAI Responses requests are completions
    requests once rendered (`frontend/openai_responses.py`)."""

    OPENAI = "openai"
    MESSAGES = "messages"
    RESPONSES = "responses"


class StreamConversion(Protocol):
    """One answer's stream, converted: the inner API's SSE payloads in, the client's SSE out."""

    def convert(self, payloads: list[bytes], end: bool = False) -> bytes: ...

    def close(self) -> None:
        """The answer ended early: nothing is left suspended."""
        ...


class Conversion(Protocol):
    """How a client's answer is made from the answer of the API inside the gateway."""

    def stream(self) -> StreamConversion: ...

    def whole(self, body: bytes) -> tuple[int, bytes]:
        """A whole inner answer (status 200) -> the client's status and body."""
        ...

    def error(self, status: int, body: bytes) -> bytes:
        """An OpenAI error body in the client's API's envelope."""
        ...


# Client fields that would let a client steer engines (P/D transfer, engine-side extra args,
# scheduling priority, prefix-cache salting): the gateway owns them, engines never see a
# client's value.
ENGINE_STEERING_FIELDS = ("kv_transfer_params", "ec_transfer_params", "vllm_xargs", "priority", "cache_salt")
# ...and fields no engine or derender reads: a large `metadata` is neither kept for the life
# of a stream nor sent anywhere.
NOT_FOR_ENGINES = ("metadata", "user", *ENGINE_STEERING_FIELDS)


@dataclass(frozen=True)
class Adapter:
    """The LoRA adapter a request's `model` names (the model catalog's resolution): engines
    get its name; render, derender and the tokenizer stay the base model's."""

    name: str
    path: str | None = None  # where the engines read it (block hashes include it)


@dataclass(frozen=True)
class OpenAIRequest:
    """The client's request, parsed once (the raw bytes are not kept)."""

    api: ApiKind
    body: dict[str, Any]
    adapter: Adapter | None = None
    family: ApiFamily = ApiFamily.OPENAI  # the client's API (MESSAGES: `body` is its chat request)
    conversion: Conversion | None = None  # the client's answer from the inner one (not OPENAI)
    # The client's own request, where engines serve its API themselves (Responses): a native
    # leg sends it as it came and the engine's answer is the client's (its usage counts the
    # prefix-cache hits native Responses reports, which completions only report with
    # --enable-prompt-tokens-details). None: a native leg sends this (inner) request.
    native: OpenAIRequest | None = None

    @property
    def model(self) -> str | None:
        model = self.body.get("model")
        return model if isinstance(model, str) else None

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    @property
    def n(self) -> int:
        n = self.body.get("n")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1

    @property
    def echo(self) -> bool:
        """The answer repeats the prompt (completions) or the last message (chat)."""
        return _flag(self.body.get("echo"))

    @property
    def logprobs(self) -> bool:
        """Output logprobs are asked for (completions: `logprobs` set, 0 included)."""
        value = self.body.get("logprobs")
        return _flag(value) if self.api is ApiKind.CHAT else value is not None

    def engine_body(self) -> dict[str, Any]:
        """The body an engine's own OpenAI endpoint gets (native path), and all the gateway
        keeps of the request once it is routed, for derender: no steering fields, no
        metadata. `messages` stay whole: tool parsers number call ids by the history."""
        return {k: v for k, v in self.body.items() if k not in NOT_FOR_ENGINES}

    def response_model(self, served_name: str) -> str:
        """The answer's `model` as native vLLM names it: the adapter's name, else the base's
        first served name (an alias is answered under that name too)."""
        return self.adapter.name if self.adapter is not None else served_name

    def kept(self) -> OpenAIRequest:
        return OpenAIRequest(self.api, self.engine_body(), self.adapter, self.family, self.conversion, self.native)

    def on_native_route(self) -> OpenAIRequest:
        """What an engine's own endpoint gets on the native path."""
        return self.native or self


@dataclass
class PromptTokens:
    """One prompt's semantic token ids (length accounting, derender, the client) and, when
    render produced them, its token-only GenerateRequest (sampling params and the rest of the
    render metadata). With token obfuscation on, `engine_request` is that request in physical
    ids, which engines and the scheduler's prefix index see (`obfuscation.py`)."""

    token_ids: list[int]
    generate_request: dict[str, Any] | None = None  # None after a local-tokenizer fallback
    engine_request: dict[str, Any] | None = None  # obfuscation on: the physical GenerateRequest

    @classmethod
    def rendered(cls, generate_request: dict[str, Any]) -> PromptTokens:
        return cls(generate_request["token_ids"], generate_request)

    @property
    def engine_ids(self) -> list[int]:
        """The ids an engine computes on: physical with obfuscation on, else the same list."""
        return self.token_ids if self.engine_request is None else self.engine_request["token_ids"]

    @property
    def sampling_params(self) -> dict[str, Any]:
        if self.generate_request is None:
            raise ValueError("no render metadata: this prompt was tokenized locally")
        params: dict[str, Any] = self.generate_request["sampling_params"]
        return params


@dataclass
class TokenizedRequest:
    """A rendered request: a single prompt is a batch of one."""

    request: OpenAIRequest
    request_id: str  # the OpenAI-style response id (chatcmpl-… / cmpl-…)
    prompts: list[PromptTokens] = field(default_factory=list)
    tokenizer_source: Literal["render", "local"] = "render"

    @property
    def api(self) -> ApiKind:
        return self.request.api

    @property
    def shows_sampled_beside_k(self) -> bool:
        """Its client sees each position's sampled token beside the engine's top k candidates
        (k + 1 entries where it ranks outside them): completions' logprobs. Chat and Responses
        show the first k (`token_only.engine_logprobs`)."""
        return self.request.api is ApiKind.COMPLETIONS and self.request.family is ApiFamily.OPENAI

    @property
    def stream(self) -> bool:
        """As render understood the request (it accepts what vLLM accepts, e.g. "true")."""
        rendered = self.prompts[0].generate_request if self.prompts else None
        return bool(rendered.get("stream")) if rendered is not None else self.request.stream

    @property
    def generate_streams(self) -> bool:
        """Whether engines stream their answer: as the client streams, unless the stream shows
        the prompt's logprobs (completions `echo` with `logprobs`), which generate only returns
        in a whole answer; then the engine answers whole and derender streams that answer."""
        return self.stream and not (self.api is ApiKind.COMPLETIONS and self.request.echo and self.request.logprobs)

    @property
    def n(self) -> int:
        """Choices per prompt, each of which may generate max_tokens."""
        rendered = self.prompts[0].generate_request if self.prompts else None
        if rendered is not None:
            return int(rendered["sampling_params"].get("n", 1))
        return self.request.n

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def complete(self) -> bool:
        """Everything a token-only GenerateRequest needs is here (render, not a local fallback)."""
        return bool(self.prompts) and all(p.generate_request is not None for p in self.prompts)


def _flag(value: Any) -> bool:
    """A boolean field as vLLM's request models read it (pydantic's lax booleans)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on", "t", "y")
    return value is True or value == 1
