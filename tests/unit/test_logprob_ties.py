"""Tied top logprobs (issue 41): the gateway shows the engine's candidates in the engine's
order, as native vLLM does, for chat, completions and Responses, streamed and whole, in both
derender modes.

The engine is vLLM's own code on scripted logprob rows with ties: its sampler's
`gather_logprobs` (torch's CPU topk, whose order among equal values depends on k) and its
`LogprobsProcessor`; generate cuts the list with its own `_create_tokens_logprobs`, asked
what `generate_body` asks. Native is vLLM's completions, chat and Responses logprobs code on
the engine's dicts for the client's k. The gateway is its in-process derender, or its sidecar
derender against a sidecar whose logprobs are vLLM's derender's (`_resolve_logprobs`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
import pytest

from ext_proc.frontend.token_only import generate_body
from ext_proc.protocol import OpenAIRequest, Pipeline, PromptTokens, TokenizedRequest

if TYPE_CHECKING:
    from ext_proc.api.responses_answer import ResponsesServing
    from ext_proc.derender.model import DerenderModel

K = 2  # the client's k, as the conformance cases ask
GREEDY = {"temperature": 0.0}
RESPONSES = "responses"  # the client API served as completions once rendered
Api = Pipeline | str  # a pipeline's own client, or RESPONSES
MODES = ("in_process", "sidecar")


@dataclass
class _Env:
    model: DerenderModel  # the gateway's
    responses: ResponsesServing  # the gateway's
    completion: Any  # native OpenAIServingCompletion (its logprobs code only)
    chat: Any  # native OpenAIServingChat (its logprobs code only)
    ids: list[int]  # candidates that decode alone to distinct plain texts

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer


@pytest.fixture(scope="module")
def env(plain_derender_model: Any) -> Iterator[_Env]:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    from ext_proc.api.responses_answer import ResponsesServing

    model = plain_derender_model
    completion, chat = object.__new__(OpenAIServingCompletion), object.__new__(OpenAIServingChat)
    completion.return_tokens_as_token_ids = chat.return_tokens_as_token_ids = False
    yield _Env(model, ResponsesServing(model, 2048), completion, chat, _plain_ids(model.tokenizer, 16))


def _plain_ids(tokenizer: Any, n: int) -> list[int]:
    """Ids whose texts differ (completions key candidates by text) and are whole characters."""
    texts: dict[str, int] = {}
    for token_id in range(300, len(tokenizer)):
        text = tokenizer.decode([token_id])
        if text.strip() and "\ufffd" not in text:
            texts.setdefault(text, token_id)
    return list(texts.values())[:n]


# -- the engine, vLLM's own code -----------------------------------------------------------


def _rows(env: _Env) -> Any:
    """Logprob rows, one per output position, with ties as bf16 logits give them: below a
    lone top, at the top, across the k-th place, and none."""
    import torch

    ids = env.ids
    layouts = [
        [(2.0, ids[0:1]), (1.0, ids[1:7]), (0.5, ids[7:12])],
        [(1.0, ids[2:10])],
        [(3.0, ids[4:5]), (2.0, ids[5:6]), (1.0, ids[0:4])],
        [(1.0 - 0.1 * i, ids[i : i + 1]) for i in range(6)],
    ]
    rows = torch.full((len(layouts), len(env.tokenizer)), -20.0)
    for row, groups in zip(rows, layouts, strict=True):
        for value, group in groups:
            row[group] = value
    rows = torch.log_softmax(rows, dim=-1)
    assert any(_topk(row, K) != _topk(row, K + 1)[:K] for row in rows), "no tie whose order depends on k"
    return rows


def _topk(row: Any, k: int) -> list[int]:
    import torch

    return [int(i) for i in torch.topk(row, k).indices]


def _greedy(rows: Any) -> list[int]:
    """The engine's greedy tokens (its sampler's argmax)."""
    return [int(i) for i in rows.argmax(dim=-1)]


def _engine(env: _Env, rows: Any, sampled: list[int], ranked: int, shown: int) -> list[dict[int, Any]]:
    """The engine's logprobs of `sampled`: its sampler ranking `ranked` candidates (a batch's
    largest k), its logprobs processor keeping the request's own `shown`."""
    import torch
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.sample.sampler import Sampler

    with torch._dynamo.config.patch(disable=True):  # its rank count, eager: no compile in a unit test
        tensors = Sampler.gather_logprobs(rows, ranked, torch.tensor(sampled, dtype=torch.int64))
    processor = LogprobsProcessor(env.tokenizer, [], None, 0.0, shown, None)
    processor._update_sample_logprobs(tensors.tolists())
    assert isinstance(processor.logprobs, list)
    return processor.logprobs


def _generate(positions: list[dict[int, Any]], sampled: list[int], asked: int) -> list[dict[str, Any]]:
    """Generate's `logprobs.content` of those positions, as its serving cuts it."""
    from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens

    logprobs = object.__new__(ServingTokens)._create_tokens_logprobs(sampled, positions, asked)
    return list(logprobs.model_dump(mode="json")["content"])


def _asked(tokenized: TokenizedRequest) -> int:
    body = orjson.loads(generate_body(tokenized.prompts[0], 16, tokenized.shows_sampled_beside_k))
    return int(body["sampling_params"]["logprobs"])


# -- native ----------------------------------------------------------------------------------


def _native(env: _Env, api: Api, positions: list[dict[int, Any]], sampled: list[int], k: int = K) -> list[Any]:
    if api is Pipeline.CHAT:
        logprobs = env.chat._create_chat_logprobs(sampled, positions, env.tokenizer, k)
        return _chat_view(logprobs.model_dump(mode="json")["content"])
    if api is Pipeline.COMPLETIONS:
        logprobs = env.completion._create_completion_logprobs(sampled, positions, K, env.tokenizer)
        return _completion_view([logprobs.model_dump(mode="json")])
    logprobs = env.responses.serving._create_response_logprobs(sampled, positions, env.tokenizer, top_logprobs=K)
    return _responses_view([lp.model_dump(mode="json") for lp in logprobs])


def _chat_view(content: list[dict[str, Any]]) -> list[Any]:
    return [
        (e["token"], e["logprob"], e["bytes"], [(t["token"], t["logprob"], t["bytes"]) for t in e["top_logprobs"]])
        for e in content
    ]


def _completion_view(chunks: list[dict[str, Any]]) -> list[Any]:
    return [
        (token, logprob, list((top or {}).items()), offset)
        for chunk in chunks
        for token, logprob, top, offset in zip(
            chunk["tokens"], chunk["token_logprobs"], chunk["top_logprobs"], chunk["text_offset"], strict=True
        )
    ]


def _responses_view(logprobs: list[dict[str, Any]]) -> list[Any]:
    return [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]]) for e in logprobs]


# -- the gateway -----------------------------------------------------------------------------


def _request(env: _Env, api: Api, params: dict[str, Any], stream: bool, k: int = K) -> TokenizedRequest:
    """A rendered request for k candidates, as the gateway serves it (Responses: as completions)."""
    prompt = [int(t) for t in env.tokenizer.encode("hi")]
    rendered = {"token_ids": prompt, "sampling_params": {"logprobs": k, **params}, "request_id": "t", "stream": stream}
    body: dict[str, Any] = {"model": "tiny", "stream": stream, **params}
    if api is Pipeline.CHAT:
        body |= {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": k}
    elif api is Pipeline.COMPLETIONS:
        body |= {"prompt": "hi", "logprobs": K}
    else:
        body |= {"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": K}
    if api is not RESPONSES:
        return TokenizedRequest(OpenAIRequest(api, body), "t", [PromptTokens.rendered(rendered)])
    request = OpenAIRequest(Pipeline.COMPLETIONS, body, path="/v1/responses")
    tokenized = TokenizedRequest(request, "t", [PromptTokens.rendered(rendered)])
    from ext_proc.api.responses import responses_request

    client = asyncio.run(responses_request(orjson.dumps(body), "t", False))
    return env.responses.inside(tokenized, client)


def _choice(sampled: list[int], content: list[dict[str, Any]], last: bool) -> dict[str, Any]:
    finish = "length" if last else None
    return {"index": 0, "token_ids": sampled, "logprobs": {"content": content}, "finish_reason": finish}


class _VllmSidecar:
    """The render sidecar's `/derender`, as far as logprobs go: vLLM's own resolution of
    generate's logprobs, which shows every candidate it gets, in its order."""

    served_name = "tiny"
    prompt_ids_every_call = False

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    async def call(self, path: str, body: bytes) -> dict[str, Any]:
        request = orjson.loads(body)
        chat = path.startswith(Pipeline.CHAT.value)
        if request.get("stream"):
            choices = request["generate_chunk"].get("choices") or []
            return {"chunk": {"choices": [self._choice(c, chat, "delta") for c in choices]}, "stream_state": {}}
        generates = [request["generate_response"]] if chat else request["generate_responses"]
        return {"choices": [self._choice(c, chat, "message") for g in generates for c in g["choices"]]}

    def _choice(self, choice: dict[str, Any], chat: bool, key: str) -> dict[str, Any]:
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateLogProbs
        from vllm.renderers.online_derenderer import _convert_chat_logprobs_to_completion_logprobs, _resolve_logprobs

        text = self._tokenizer.decode(choice["token_ids"])
        logprobs = _resolve_logprobs(GenerateLogProbs.model_validate(choice["logprobs"]), self._tokenizer)
        out = {"index": choice["index"], "token_ids": choice["token_ids"], "finish_reason": choice["finish_reason"]}
        if chat:
            return {**out, key: {"role": "assistant", "content": text}, "logprobs": logprobs.model_dump(mode="json")}
        completion = _convert_chat_logprobs_to_completion_logprobs(logprobs)
        return {**out, "text": text, "logprobs": completion.model_dump(mode="json")}


def _gateway(env: _Env, tokenized: TokenizedRequest, generate: list[dict[str, Any]], mode: str) -> list[Any]:
    """The client's logprobs through the gateway's derender of generate's answer."""
    sampled = [int(e["token_id"]) for e in generate]
    if tokenized.request.stream:  # an engine event per token
        pairs = enumerate(zip(sampled, generate, strict=True))
        events = [{"choices": [_choice([t], [e], i == len(sampled) - 1)]} for i, (t, e) in pairs]
        sse = _stream(env, tokenized, events, mode)
        payloads = [frame.removeprefix(b"data: ") for frame in sse.split(b"\n\n") if frame]
        answer = tokenized.request.conversion
        if answer is not None:
            return _responses_stream_view(answer.stream().convert(payloads, end=True))
        chunks = [orjson.loads(p)["choices"][0]["logprobs"] for p in payloads if orjson.loads(p)["choices"]]
        chunks = [c for c in chunks if c is not None]
    else:
        whole = _whole(env, tokenized, {"choices": [_choice(sampled, generate, True)]}, mode)
        if tokenized.request.conversion is not None:
            status, body = tokenized.request.conversion.whole(whole)
            assert status == 200, body
            return _responses_view(orjson.loads(body)["output"][0]["content"][0]["logprobs"])
        chunks = [orjson.loads(whole)["choices"][0]["logprobs"]]
    if tokenized.api is Pipeline.CHAT:
        return _chat_view([e for chunk in chunks for e in chunk["content"]])
    return _completion_view(chunks)


def _stream(env: _Env, tokenized: TokenizedRequest, events: list[dict[str, Any]], mode: str) -> bytes:
    if mode == "in_process":
        from ext_proc.derender.in_process import stream_session

        return bytes(stream_session(env.model, tokenized).steps(events))
    from ext_proc.derender.sidecar import SidecarStream

    stream = SidecarStream(_VllmSidecar(env.tokenizer), tokenized, 0, env.model)  # type: ignore[arg-type]
    return b"".join(asyncio.run(stream.steps([(e, orjson.dumps(e))])) for e in events)


def _whole(env: _Env, tokenized: TokenizedRequest, generate: dict[str, Any], mode: str) -> bytes:
    if mode == "in_process":
        from ext_proc.derender.in_process import derender_whole

        return derender_whole(env.model, tokenized, generate)
    from ext_proc.derender.sidecar import SidecarDerender

    derender = SidecarDerender(_VllmSidecar(env.tokenizer), env.model)  # type: ignore[arg-type]
    return asyncio.run(derender.whole(tokenized, orjson.dumps(generate)))


def _responses_stream_view(sse: bytes) -> list[Any]:
    frames = [frame.split(b"\ndata: ", 1)[1] for frame in sse.split(b"\n\n") if frame]
    [completed] = [e for e in map(orjson.loads, frames) if e["type"] == "response.completed"]
    return _responses_view(completed["response"]["output"][0]["content"][0]["logprobs"])


# -- the tests -------------------------------------------------------------------------------

# (api, rendered sampling params, derender mode): each client is shown the engine's first k
# candidates (chat, Responses) or its whole dict for k (completions, the sampled token the
# argmax). Responses derender in process in either mode (`OpenAIRequest.per_step`).
EXACT = [
    *(pytest.param(Pipeline.CHAT, {}, mode, id=f"chat-{mode}") for mode in MODES),
    *(pytest.param(Pipeline.COMPLETIONS, GREEDY, mode, id=f"completions-greedy-{mode}") for mode in MODES),
    pytest.param(RESPONSES, {}, "in_process", id="responses"),
    pytest.param(RESPONSES, GREEDY, "in_process", id="responses-greedy"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("api", "params", "mode"), EXACT)
def test_tied_candidates_come_in_the_engines_order_as_natively(
    env: _Env, api: Api, params: dict[str, Any], mode: str, stream: bool
) -> None:
    rows = _rows(env)
    sampled = _greedy(rows) if params else [env.ids[12], env.ids[1], env.ids[13], env.ids[0]]
    tokenized = _request(env, api, params, stream)
    asked = _asked(tokenized)
    generate = _generate(_engine(env, rows, sampled, asked, asked), sampled, asked)
    native = _native(env, api, _engine(env, rows, sampled, K, K), sampled)
    assert _gateway(env, tokenized, generate, mode) == native


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", MODES)
def test_chat_logprobs_without_top_logprobs_show_no_candidate_as_natively(env: _Env, mode: str, stream: bool) -> None:
    """`top_logprobs: 0`: native shows none; generate keeps one (its cut is max(k, 1)), which
    vLLM's `/derender` would show."""
    rows = _rows(env)
    sampled = [env.ids[12], env.ids[1], env.ids[13], env.ids[0]]
    generate = _generate(_engine(env, rows, sampled, 0, 0), sampled, 0)
    assert all(len(entry["top_logprobs"]) == 1 for entry in generate)
    native = _native(env, Pipeline.CHAT, _engine(env, rows, sampled, 0, 0), sampled, k=0)
    assert _gateway(env, _request(env, Pipeline.CHAT, {}, stream, k=0), generate, mode) == native


@pytest.mark.parametrize(
    ("api", "params", "asked"),
    [
        pytest.param(Pipeline.CHAT, {}, K, id="chat"),
        pytest.param(RESPONSES, {}, K, id="responses"),
        pytest.param(Pipeline.COMPLETIONS, GREEDY, K, id="completions-greedy"),
        pytest.param(Pipeline.COMPLETIONS, {}, K + 1, id="completions-sampled"),
        pytest.param(Pipeline.COMPLETIONS, {**GREEDY, "logit_bias": {"5": 9}}, K + 1, id="completions-biased"),
        pytest.param(Pipeline.COMPLETIONS, {**GREEDY, "repetition_penalty": 1.2}, K + 1, id="completions-penalty"),
        pytest.param(Pipeline.COMPLETIONS, {**GREEDY, "min_tokens": 3}, K + 1, id="completions-min-tokens"),
    ],
)
def test_the_engine_is_asked_for_the_clients_k_unless_completions_may_show_one_more(
    env: _Env, api: Api, params: dict[str, Any], asked: int
) -> None:
    """Completions show the sampled token beside the top k; where it may rank below k (any
    sampling, or a greedy token something steers off the raw argmax) generate would cut the
    k-th candidate, so the engine gets one more (`token_only.engine_logprobs`)."""
    assert _asked(_request(env, api, params, stream=False)) == asked


@pytest.mark.parametrize("k", [0, -1, 20])
def test_completions_ask_k_where_nothing_can_be_cut_or_no_more_may_be_asked(env: _Env, k: int) -> None:
    tokenized = _request(env, Pipeline.COMPLETIONS, {}, stream=False)
    assert tokenized.prompts[0].generate_request is not None
    tokenized.prompts[0].generate_request["sampling_params"]["logprobs"] = k
    assert _asked(tokenized) == k


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_sampled_completions_miss_no_candidate_and_order_ties_as_a_native_batch_asking_one_more(
    env: _Env, stream: bool, mode: str
) -> None:
    """The residual of sampled completions: asked for k + 1, the engine ranks with
    `topk(k + 1)`. The answer is native's when its batch holds a request for k + 1 (the
    sampler ranks a batch at its largest k); against native alone it has the same values and
    as many candidates, tied ones possibly in another order."""
    rows = _rows(env)
    sampled = [env.ids[12], env.ids[1], env.ids[13], env.ids[0]]  # two below the top k
    tokenized = _request(env, Pipeline.COMPLETIONS, {}, stream)
    asked = _asked(tokenized)
    gateway = _gateway(env, tokenized, _generate(_engine(env, rows, sampled, asked, asked), sampled, asked), mode)
    assert gateway == _native(env, Pipeline.COMPLETIONS, _engine(env, rows, sampled, K + 1, K), sampled)
    alone = _native(env, Pipeline.COMPLETIONS, _engine(env, rows, sampled, K, K), sampled)
    assert [[lp for _, lp in top] for _, _, top, _ in gateway] == [[lp for _, lp in top] for _, _, top, _ in alone]
    assert K + 1 in [len(top) for _, _, top, _ in gateway]  # where generate asked for k cuts one
