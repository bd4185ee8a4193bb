"""OpenAI Responses over completions (ext_proc.api.responses_answer.py): vLLM's Responses stream
generator stepped by hand over a completions stream gives exactly what it gives when native
serving drives it with the engine's outputs, however the chunks are grouped; the whole answer
is native's; the request front refuses what native refuses without a store; output logprobs
are the engine's."""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

import orjson
import pytest

from ext_proc.errors import GatewayError
from ext_proc.protocol import OpenAIRequest, Pipeline, PromptTokens, TokenizedRequest

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
PIECES = ["<think>", "Hm,", " so", "</think>", "Hello", " there", "\n", "<tool_call>", "🐉"]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def serving(derender_model: Any) -> Any:
    from ext_proc.api.responses_answer import ResponsesServing

    return ResponsesServing(derender_model, 2048)


def _client(body: dict[str, Any], store: bool = False) -> Any:
    """vLLM's model of the request; `store`: with the gateway's response store (else as native
    without one)."""
    from ext_proc.api.responses import responses_request

    return asyncio.run(responses_request(orjson.dumps({"model": "tiny", "input": "hi", **body}), "t", store))


def _inside(serving: Any, client: Any, stream: bool, sampling: dict[str, Any] | None = None) -> TokenizedRequest:
    ids = [int(t) for t in serving.model.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")]
    params = sampling or {"max_tokens": 50}
    rendered = {"token_ids": ids, "sampling_params": params, "request_id": client.request_id}
    rendered["stream"] = stream
    request = OpenAIRequest(Pipeline.COMPLETIONS, {"model": "tiny", "input": "hi"}, path="/v1/responses")
    return serving.inside(TokenizedRequest(request, client.request_id, [PromptTokens.rendered(rendered)]), client)


def _steps(serving: Any, rng: random.Random) -> list[tuple[str, list[int]]]:
    """(text, ids) per engine step: pieces of reasoning, content and tool-call markup."""
    tokenizer = serving.model.tokenizer
    text = "".join(rng.choice([*PIECES, CALL]) for _ in range(rng.randint(0, 8)))
    ids = [int(t) for t in tokenizer.encode(text)]
    steps, shown = [], ""
    for i in range(len(ids)):
        full = tokenizer.decode(ids[: i + 1])
        steps.append((full[len(shown) :], ids[i : i + 1]))
        shown = full
    return steps


def _completions(steps: list[tuple[str, list[int]]], finish: str) -> list[bytes]:
    out = []
    for i, (text, ids) in enumerate(steps):
        last = i == len(steps) - 1
        choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish if last else None}
        out.append(orjson.dumps({"id": "cmpl-t", "object": "text_completion", "choices": [choice]}))
    if not steps:
        choice = {"index": 0, "text": "", "token_ids": [], "finish_reason": finish}
        out.append(orjson.dumps({"id": "cmpl-t", "choices": [choice]}))
    usage = {"prompt_tokens": 9, "completion_tokens": len(steps), "total_tokens": 9 + len(steps)}
    return [*out, orjson.dumps({"id": "cmpl-t", "choices": [], "usage": usage}), b"[DONE]"]


def _native(serving: Any, answer: Any, steps: list[tuple[str, list[int]]], finish: str) -> str:
    """What native's route streams: its generator over the engine's outputs, one per step."""
    context = answer.context()
    outputs = [
        answer.output({"text": t, "token_ids": ids, "finish_reason": finish if i == len(steps) - 1 else None})
        for i, (t, ids) in enumerate(steps)
    ] or [answer.output({"text": "", "token_ids": [], "finish_reason": finish})]

    async def engine() -> Any:
        for output in outputs:
            context.append_output(output)
            yield context

    async def run() -> str:
        args = answer.generator_args(context, 0)
        events = serving.serving.responses_stream_generator(answer.client, args[0], engine(), *args[1:])
        return "".join(
            [f"event: {e.type}\ndata: {e.model_dump_json(indent=None, by_alias=True)}\n\n" async for e in events]
        )

    return asyncio.run(run())


def _normalized(text: str) -> str:
    text = re.sub(r'"(msg|fc|rs|call|resp)_[0-9a-zA-Z_-]+"', r'"\1_X"', text)
    text = re.sub(r"chatcmpl-tool-[0-9a-f]+", "chatcmpl-tool-X", text)
    return re.sub(r'"created_at":\d+', '"created_at":0', text)


@pytest.mark.parametrize("tools", [[], [TOOL]])
def test_the_stepped_generator_equals_native_on_200_streams_grouped_any_way(serving: Any, tools: Any) -> None:
    rng = random.Random(7)
    client = _client({"tools": tools, "stream": True})
    for _ in range(100):
        steps = _steps(serving, rng)
        finish = rng.choice(["stop", "length"])
        tokenized = _inside(serving, client, stream=True)
        answer = tokenized.request.conversion
        expected = _normalized(_native(serving, answer, steps, finish))
        payloads, stream, out, i = _completions(steps, finish), answer.stream(), b"", 0
        while i < len(payloads):
            k = rng.randint(1, 4)
            out += stream.convert(payloads[i : i + k])
            i += k
        assert _normalized(out.decode()) == expected
        assert b"response.completed" in out and b"[DONE]" not in out


def test_the_whole_answer_is_natives(serving: Any) -> None:
    client = _client({"tools": [TOOL]})
    tokenized = _inside(serving, client, stream=False)
    answer = tokenized.request.conversion
    text = "<think>Hm</think>" + CALL
    ids = [int(t) for t in serving.model.tokenizer.encode(text)]
    choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": "stop"}
    usage = {"prompt_tokens": 9, "completion_tokens": len(ids), "total_tokens": 9 + len(ids)}
    status, body = answer.whole(orjson.dumps({"choices": [choice], "usage": usage}))
    assert status == 200
    response = orjson.loads(body)
    assert response["id"] == client.request_id and response["status"] == "completed"
    assert [item["type"] for item in response["output"]] == ["reasoning", "function_call"]
    assert orjson.loads(response["output"][1]["arguments"]) == {"city": "Paris"}
    prompt_tokens = len(tokenized.prompts[0].token_ids)
    assert response["usage"]["output_tokens"] == len(ids) and response["usage"]["input_tokens"] == prompt_tokens
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


def test_an_error_ends_the_stream_with_an_error_event(serving: Any) -> None:
    client = _client({"stream": True})
    stream = _inside(serving, client, stream=True).request.conversion.stream()
    error = {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}
    out = stream.convert([*_completions([("Hi", [9707])], "stop")[:1], orjson.dumps(error), b"[DONE]"]).decode()
    events = [orjson.loads(line[6:]) for line in out.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "error" and events[-1]["message"] == "boom"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "response.completed" not in out


def test_the_completions_request_inside_carries_renders_params_and_asks_for_usage(serving: Any) -> None:
    client = _client({"stream": True})
    tokenized = _inside(serving, client, stream=True)
    assert tokenized.request.api is Pipeline.COMPLETIONS
    body = tokenized.request.body
    assert body["prompt"] == tokenized.prompts[0].token_ids and body["max_tokens"] == 50
    assert body["return_token_ids"] and body["stream_options"] == {"include_usage": True}
    assert tokenized.prompts[0].generate_request is not None
    assert tokenized.prompts[0].generate_request["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"background": True}, 400, "background"),
        ({"previous_response_id": "resp_1"}, 404, "response_id"),
        ({"input": 5}, 400, None),
    ],
)
def test_what_native_refuses_without_a_store_is_refused(
    serving: Any, body: dict[str, Any], status: int, param: str | None
) -> None:
    with pytest.raises(GatewayError) as refused:
        _client(body)
    assert refused.value.status == status
    error = orjson.loads(refused.value.body)["error"]
    if param is not None:
        assert error["param"] == param
    if status == 404:
        assert error == {
            "message": "Response with id 'resp_1' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tool_choice": "required"}, "Tool choice 'required' must be specified with 'tools' parameter."),
        (
            {
                "tools": [{"type": "function", "name": "f", "parameters": {}}],
                "tool_choice": {"type": "function", "name": "g"},
            },
            "Tool choice 'function' not found in 'tools' parameter.",
        ),
    ],
)
def test_a_tool_choice_the_models_own_validator_refuses_is_natives_400(body: dict[str, Any], message: str) -> None:
    with pytest.raises(GatewayError) as refused:
        _client(body)
    assert refused.value.status == 400
    assert orjson.loads(refused.value.body) == {
        "error": {
            "message": f"{message} (parameter=tool_choice)",
            "type": "BadRequestError",
            "param": "tool_choice",
            "code": 400,
        }
    }


def test_built_in_tools_are_kept_as_a_stock_engine_keeps_them() -> None:
    """Native without a tool server renders only the function tools and echoes them all."""
    tools = [{"type": "web_search_preview"}, {"type": "function", "name": "f", "parameters": {}}]
    client = _client({"tools": tools})
    assert [tool.type for tool in client.tools] == ["web_search_preview", "function"]


def test_with_a_store_only_background_is_refused_and_store_is_kept() -> None:
    from ext_proc.api.responses import BACKGROUND

    with pytest.raises(GatewayError) as refused:
        _client({"background": True}, store=True)
    assert refused.value.status == 400 and orjson.loads(refused.value.body)["error"]["message"] == BACKGROUND
    assert _client({"previous_response_id": "resp_1"}, store=True).previous_response_id == "resp_1"
    assert _client({}, store=True).store is True and _client({}, store=False).store is False
    assert _client({"store": False}, store=True).store is False


# Output logprobs: the completions request inside asks for token-id logprobs, and each step's
# become the `dict[id, Logprob]` per position the engine's own logprobs processor makes.
TOP = 3
LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": TOP}


def _logprobs_inside(serving: Any, body: dict[str, Any], sampling: dict[str, Any]) -> TokenizedRequest:
    return _inside(serving, _client(body), True, sampling)


def test_the_request_inside_asks_for_token_id_logprobs_only_when_included(serving: Any) -> None:
    body = _logprobs_inside(serving, LOGPROBS, {"max_tokens": 5, "logprobs": TOP}).request.body
    assert body["logprobs"] == TOP and body["return_tokens_as_token_ids"] is True
    body = _logprobs_inside(serving, {}, {"max_tokens": 5}).request.body
    assert "logprobs" not in body and "return_tokens_as_token_ids" not in body


def _engine_positions(tokenizer: Any, steps: list[tuple[list[int], list[float], int]]) -> list[dict[int, Any]]:
    """What native's engine holds: vLLM's own logprobs processor fed the sampler's rows."""
    import numpy as np
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    processor = LogprobsProcessor(tokenizer, [], None, 0.0, TOP, None)
    for ids, logprobs, rank in steps:
        processor._update_sample_logprobs(LogprobsLists(np.array([ids]), np.array([logprobs]), np.array([rank])))
    assert processor.logprobs is not None
    return list(processor.logprobs)


def _completions_logprobs(position: dict[int, Any]) -> dict[str, Any]:
    """Native completions' logprobs of one position with `return_tokens_as_token_ids`."""
    sampled, first = next(iter(position.items()))
    return {
        "tokens": [f"token_id:{sampled}"],
        "token_logprobs": [first.logprob],
        "top_logprobs": [{f"token_id:{t}": lp.logprob for i, (t, lp) in enumerate(position.items()) if i <= TOP}],
        "text_offset": [0],
    }


def test_each_steps_logprobs_are_the_engines_positions(serving: Any) -> None:
    tokenizer = serving.model.tokenizer
    rng = random.Random(7)
    sampled = [int(t) for t in tokenizer.encode("Hi 🐉 東京 🗼!")]  # characters split over byte tokens
    pieces = [int(t) for t in tokenizer.encode("🐉🗼東")]  # candidates that decode to "" alone
    steps = []
    for token in sampled:
        top = rng.sample([*pieces, *rng.sample(range(1000), 3)], TOP)
        ids = [token, *top]
        logprobs = sorted((-rng.random() * 9 for _ in ids), reverse=True)
        steps.append((ids, [logprobs[0], *logprobs[1:]], rng.randint(1, TOP + 2)))
    engine = _engine_positions(tokenizer, steps)
    answer = _logprobs_inside(serving, LOGPROBS, {"max_tokens": 20, "logprobs": TOP}).request.conversion
    assert answer is not None
    for position in engine:
        choice = {"text": "", "token_ids": [next(iter(position))], "logprobs": _completions_logprobs(position)}
        [ours] = answer.output(choice).outputs[0].logprobs
        shown = list(position.items())[: TOP + 1]
        assert [(t, lp.logprob, lp.decoded_token) for t, lp in ours.items()] == [
            (t, lp.logprob, lp.decoded_token) for t, lp in shown
        ]
    assert any(lp.decoded_token == "" for position in engine for lp in position.values())


def test_a_step_without_logprobs_has_none(serving: Any) -> None:
    answer = _logprobs_inside(serving, {}, {"max_tokens": 5}).request.conversion
    assert answer.output({"text": "a", "token_ids": [64]}).outputs[0].logprobs is None
