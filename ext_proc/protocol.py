"""Gateway-side protocol models: what the processor knows about one OpenAI request.

Wire bodies of vLLM (GenerateRequest, generate chunks, derender requests) stay as the JSON
they are on the wire; these models only carry what the gateway itself reasons about.
"""

from __future__ import annotations

import enum
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import orjson

GENERATE_PATH = "/inference/v1/generate"
DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default, omitted from render output when equal


@dataclass(frozen=True)
class DataPlane:
    """What the proxy in front lets the processor do with one request: tito's own Envoy allows
    everything; a Gateway API Inference Extension gateway may name a subset of engines and may
    not stream the response body through the processor (`envoy_protocol/epp.py`)."""

    # The engines ("ip:port") the request's legs may use, relays too (EPP protocol §Endpoint
    # Subset); None: any engine of the pool.
    within: frozenset[str] | None = None
    # The response body passes through the processor, so the request may become a token-only
    # generate whose chunks are derendered. False: the engine's own route, the body as it came.
    rewrites: bool = True


@dataclass(frozen=True)
class Flow:
    """Whose share of the gateway a request takes (flow control): its flow (an API key's
    tenant, a fairness header, or "default"), its priority band (below 0: sheddable) and its
    weight within the band; a tenant's quotas when it has any."""

    name: str = "default"
    priority: int = 0
    weight: float = 1.0
    tokens_per_minute: int | None = None
    tenant: str | None = None  # the API key's tenant (None: no key, or keys are off)
    models: frozenset[str] = frozenset()  # the models its tenant may use (empty: every model)


# The data plane of the request being planned: set by the Envoy exchange around planning and
# read once, when the rendered request is placed (`TokenizedRequest.data_plane`). None: the
# request came some other way (tito's own Envoy allows everything).
DATA_PLANE: ContextVar[DataPlane | None] = ContextVar("data_plane", default=None)
FLOW: ContextVar[Flow | None] = ContextVar("flow", default=None)  # likewise, its flow


class Pipeline(enum.Enum):
    """The two ways a request becomes token ids and ids become an answer, which every client
    API feeds (`ext_proc/api/`): a chat (messages through the chat template) or a completions
    prompt. The value is the vLLM endpoint serving a body of that pipeline."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"

    @property
    def derender_path(self) -> str:
        return self.value + "/derender"

    @property
    def client_request_key(self) -> str:
        """Where derender expects the original client request."""
        return "chat_request" if self is Pipeline.CHAT else "completion_request"


class StreamConversion(Protocol):
    """One answer's stream, converted: the pipeline's SSE payloads in, the client's SSE out."""

    def convert(self, payloads: list[bytes], end: bool = False) -> bytes: ...

    def ended(self, status: int, body: bytes) -> bytes:
        """The stream's last bytes when the gateway ends it (an eviction, the drain deadline, a
        bug) with this error (OpenAI's body): the client's API's error event."""
        ...

    def close(self) -> None:
        """The answer ended early: nothing is left suspended."""
        ...


class Conversion(Protocol):
    """How a client API's answer is made from the answer of the pipeline its request is served as."""

    def stream(self) -> StreamConversion: ...

    def whole(self, body: bytes) -> tuple[int, bytes]:
        """A whole pipeline answer (status 200) -> the client's status and body."""
        ...

    def error(self, status: int, body: bytes) -> bytes:
        """An OpenAI error body in the client's API's envelope."""
        ...

    async def finished(self) -> None:
        """The client's answer is whole (its last bytes not yet sent): what must be done
        before the client can act on it (a stored Responses turn is kept)."""
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


LAX_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})  # the strings pydantic reads as True


@dataclass(frozen=True)
class OpenAIRequest:
    """A client's request as its API room hands it to the pipeline, parsed once (the raw
    bytes are not kept)."""

    api: Pipeline
    body: dict[str, Any]
    adapter: Adapter | None = None
    # The vLLM endpoint that serves `body` as it is, where that is not its pipeline's own (a
    # client API whose body render reads at `path + "/render"`, before its API room makes it
    # a pipeline request): render there, no local tokenizer, a native leg there.
    path: str | None = None
    conversion: Conversion | None = None  # the client's answer from the pipeline's (None: the same)
    # The client's answer is made per engine step (its API parses each step's output ids):
    # steps stay apart, and derender runs in process (the sidecar's /derender lacks the ids).
    per_step: bool = False
    # The client's own request, where engines serve its API themselves: a native leg sends it
    # as it came and the engine's answer is the client's (e.g. usage an engine reports only
    # on that endpoint). None: a native leg sends this (pipeline) request.
    native: OpenAIRequest | None = None
    # vLLM's own model of `body` (its request class, as its API server validates it), where
    # render made one in this process: derender reads that one instead of validating the
    # body again, as native serving's stream generator reads the object its render read.
    validated: Any = field(default=None, compare=False, repr=False)

    @property
    def model(self) -> str | None:
        model = self.body.get("model")
        return model if isinstance(model, str) else None

    @property
    def stream(self) -> bool:
        """As vLLM's request models read it (pydantic's lax bool: `"true"` and 1 stream too)."""
        value = self.body.get("stream")
        if isinstance(value, str):
            return value.lower() in LAX_TRUE
        return value is True or (type(value) in (int, float) and value == 1)

    @property
    def n(self) -> int:
        n = self.body.get("n")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1

    @property
    def echo(self) -> bool:
        """The answer repeats the prompt (completions) or the last message (chat)."""
        return _flag(self.body.get("echo"))

    @property
    def beam_search(self) -> bool:
        """vLLM's beam search (`use_beam_search`), which the gateway runs itself (`legs/beam.py`)."""
        return _flag(self.body.get("use_beam_search"))

    @property
    def logprobs(self) -> bool:
        """Output logprobs are asked for (completions: `logprobs` set, 0 included)."""
        value = self.body.get("logprobs")
        return _flag(value) if self.api is Pipeline.CHAT else value is not None

    @property
    def endpoint(self) -> str:
        """The vLLM endpoint serving this body: its render route is this + "/render"."""
        return self.path or self.api.value

    def engine_body(self) -> dict[str, Any]:
        """The body an engine's own OpenAI endpoint gets (native path), and all the gateway
        keeps of the request once it is routed, for derender: no steering fields, no
        metadata. `messages` stay whole: tool parsers number call ids by the history."""
        return {k: v for k, v in self.body.items() if k not in NOT_FOR_ENGINES}

    def engine_bytes(self, raw: bytes) -> bytes:
        """The client's body (`raw`) for an engine's own endpoint: as sent, unless it carries
        fields an engine must not get (then re-encoded without them)."""
        if any(key in self.body for key in NOT_FOR_ENGINES):
            return orjson.dumps(self.engine_body())
        return raw

    def response_model(self, served_name: str) -> str:
        """The answer's `model` as native vLLM names it: the adapter's name, else the base's
        first served name (an alias is answered under that name too)."""
        return self.adapter.name if self.adapter is not None else served_name

    def kept(self) -> OpenAIRequest:
        return replace(self, body=self.engine_body())

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
    data_plane: DataPlane = DataPlane()  # what the proxy in front allows (tito's own Envoy: everything)
    flow: Flow = Flow()  # whose share it takes (flow control)

    @property
    def api(self) -> Pipeline:
        return self.request.api

    @property
    def shows_sampled_beside_k(self) -> bool:
        """Its client sees each position's sampled token beside the engine's top k candidates
        (k + 1 entries where it ranks outside them): completions' logprobs shown as they are.
        Chat, and an API converting the answer, show the first k (`token_only.engine_logprobs`)."""
        return self.request.api is Pipeline.COMPLETIONS and self.request.conversion is None

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
        return self.stream and not (self.api is Pipeline.COMPLETIONS and self.request.echo and self.request.logprobs)

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

    @property
    def rewritable(self) -> bool:
        """It may become token-only generate legs: complete, and its answer passes through here."""
        return self.complete and self.data_plane.rewrites


def _flag(value: Any) -> bool:
    """A boolean field as vLLM's request models read it (pydantic's lax booleans)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on", "t", "y")
    return value is True or value == 1
