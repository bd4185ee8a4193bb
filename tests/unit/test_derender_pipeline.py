"""The streaming derender pipeline on its own: per-choice state, one [DONE], errors."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from ext_proc.derender.pipeline import StreamDerender, parse_event
from ext_proc.derender.sidecar import DerenderClient, SidecarStream
from ext_proc.errors import GatewayError
from ext_proc.protocol import OpenAIRequest, Pipeline, PromptTokens, TokenizedRequest

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2}


class FakeDerender:
    """Answers like vLLM's streaming derender; the state counts calls per choice."""

    served_name = "tiny"
    prompt_ids_every_call = False

    def __init__(self, fail_on_call: int | None = None) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail_on_call = fail_on_call

    async def call(self, path: str, body: bytes) -> dict[str, Any]:
        request = orjson.loads(body)  # the spliced body must be valid JSON
        self.requests.append(request)
        if self.fail_on_call == len(self.requests):
            raise GatewayError(422, "invalid stream_state", code="derender_rejected")
        chunk = request["generate_chunk"]
        choices = [{"index": c["index"], "delta": {"content": f"t{c['token_ids'][0]}"}} for c in chunk["choices"]]
        state = request["stream_state"] or {"calls": 0}
        return {
            "chunk": {"id": chunk.get("request_id"), "choices": choices},
            "stream_state": {"calls": state["calls"] + 1},
        }


def _session(fake: FakeDerender, has_parser: bool = False) -> SidecarStream:
    fake.prompt_ids_every_call = has_parser
    request = OpenAIRequest(Pipeline.CHAT, BODY)
    prompt = PromptTokens.rendered({"token_ids": [1, 2, 3], "sampling_params": {}, "request_id": "chatcmpl-x"})
    tokenized = TokenizedRequest(request, "chatcmpl-x", [prompt])
    client: DerenderClient = fake  # type: ignore[assignment]
    model = SimpleNamespace(system_fingerprint=lambda: None)  # what a stream without a parser reads of it
    return SidecarStream(client, tokenized, 0, model)  # type: ignore[arg-type]


def _pipeline(fake: FakeDerender, has_parser: bool = False) -> StreamDerender:
    return StreamDerender(_session(fake, has_parser))


def _event(index: int, token: int) -> bytes:
    chunk = {"request_id": "generate-tokens-chatcmpl-x", "choices": [{"index": index, "token_ids": [token]}]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _events(out: bytes) -> list[Any]:
    return [e.removeprefix(b"data: ") for e in out.split(b"\n\n") if e]


async def test_each_choice_keeps_its_own_state_and_seed() -> None:
    fake = FakeDerender()
    pipeline = _pipeline(fake)
    stream = _event(0, 5) + _event(1, 6) + _event(0, 7) + _event(1, 8) + b"data: [DONE]\n\n"
    out = b""
    for i in range(0, len(stream), 7):  # events cut anywhere
        out += await pipeline.feed(stream[i : i + 7])
    out += await pipeline.finish()
    assert [r["stream_state"] for r in fake.requests] == [None, None, {"calls": 1}, {"calls": 1}]
    assert ["prompt_token_ids" in r for r in fake.requests] == [True, True, False, False]
    assert all(r["chat_request"] == BODY and r["prompt_tokens"] == 3 for r in fake.requests)
    events = _events(out)
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert [c["id"] for c in chunks] == ["chatcmpl-x"] * 6  # not generate-tokens-…
    # each choice opens with the role alone, as native does (vLLM 0.32's derender puts it on the first token)
    roles = [c["choices"][0] for c in chunks if "role" in c["choices"][0]["delta"]]
    assert [(c["index"], c["delta"]) for c in roles] == [(i, {"role": "assistant", "content": ""}) for i in (0, 1)]
    content = [c["choices"][0]["delta"]["content"] for c in chunks if "role" not in c["choices"][0]["delta"]]
    assert content == ["t5", "t6", "t7", "t8"]


async def test_done_is_added_when_the_engine_stream_just_ends() -> None:
    pipeline = _pipeline(FakeDerender())
    out = await pipeline.feed(_event(0, 5)) + await pipeline.finish()
    assert _events(out)[-1] == b"[DONE]"
    assert await pipeline.finish() == b""  # and never twice


async def test_inband_engine_error_ends_the_stream() -> None:
    fake = FakeDerender()
    pipeline = _pipeline(fake)
    error = b'data: {"error": {"message": "engine core died", "code": 500}}\n\n'
    out = await pipeline.feed(_event(0, 5) + error + _event(0, 6) + b"data: [DONE]\n\n")
    out += await pipeline.finish()
    events = _events(out)  # the role, t5, the error
    assert orjson.loads(events[2])["error"]["message"] == "engine core died"
    assert events[3:] == [b"[DONE]"]
    assert len(fake.requests) == 1  # the error event and what followed never reached derender


async def test_an_engine_error_object_reaches_the_client_as_the_engine_sent_it() -> None:
    """What vLLM streams for a request it rejects mid-stream (e.g. a logit_bias id outside the
    vocabulary): native serving sends the very same object."""
    engine_error = {
        "message": "token_id(s) [99999] in logit_bias out of vocab",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    pipeline = _pipeline(FakeDerender())
    out = await pipeline.feed(b"data: " + orjson.dumps({"error": engine_error}) + b"\n\n")
    events = _events(out + await pipeline.finish())
    assert orjson.loads(events[-2]) == {"error": engine_error} and events[-1] == b"[DONE]"
    error = parse_event(orjson.dumps({"error": engine_error}))
    assert isinstance(error, GatewayError) and (error.status, error.code) == (400, 400)


async def test_derender_failure_does_not_advance_the_state() -> None:
    fake = FakeDerender(fail_on_call=2)
    session = _session(fake)
    pipeline = StreamDerender(session)
    out = b""
    for token in (5, 6, 7):  # one event at a time: nothing to coalesce
        out += await pipeline.feed(_event(0, token))
    events = _events(out + await pipeline.finish())  # the role, t5, the error
    assert orjson.loads(events[2])["error"]["code"] == "derender_rejected"
    assert events[3:] == [b"[DONE]"]
    assert len(fake.requests) == 2
    assert session._states == {0: {"calls": 1}}


@pytest.mark.parametrize("bad", [b"data: {not json\n\n", b'data: {"choices": []}\n\n'])
async def test_bad_events_never_hang_the_stream(bad: bytes) -> None:
    pipeline = _pipeline(FakeDerender())
    out = await pipeline.feed(bad) + await pipeline.finish()
    assert _events(out)[-1] == b"[DONE]"


async def test_with_a_parser_every_call_carries_the_full_prompt_ids() -> None:
    fake = FakeDerender()
    pipeline = _pipeline(fake, has_parser=True)
    for token in (5, 6, 7):
        await pipeline.feed(_event(0, token))
    assert [r.get("prompt_token_ids") for r in fake.requests] == [[1, 2, 3]] * 3


async def test_events_waiting_together_are_one_step_per_choice() -> None:
    """Backpressure: what arrives in one body chunk is derendered once per run of one choice."""
    fake = FakeDerender()
    pipeline = _pipeline(fake)
    finish = b'data: {"choices": [{"index": 0, "token_ids": [9], "finish_reason": "length"}]}\n\n'
    out = await pipeline.feed(_event(0, 5) + _event(0, 6) + _event(1, 7) + _event(0, 8) + finish + _event(0, 10))
    steps = [
        [(c["index"], c["token_ids"], c.get("finish_reason")) for c in r["generate_chunk"]["choices"]]
        for r in fake.requests
    ]
    assert steps == [[(0, [5, 6], None)], [(1, [7], None)], [(0, [8, 9], "length")], [(0, [10], None)]]
    assert len(_events(out)) == 4 + 2  # and each choice's role chunk


def test_sidecar_stop_strings_are_held_back_and_cut_across_fields() -> None:
    from ext_proc.derender.sidecar_corrections import StopCut

    stop = StopCut(["END!", "xyz"])
    assert stop.feed([("reasoning", "think "), ("content", "ab")], final=False) == [("reasoning", "think")]
    assert stop.feed([("content", "cE")], final=False) == [
        ("reasoning", " "),
        ("content", "a"),
    ]  # "bcE" may begin "END!"
    assert stop.feed([("content", "ND! more")], final=False) == [("content", "bc")]
    assert stop.feed([("content", "late")], final=True) == []  # nothing after a stop string


def test_sidecar_text_held_back_is_flushed_at_the_finish() -> None:
    from ext_proc.derender.sidecar_corrections import StopCut

    stop = StopCut(["END!"])
    assert stop.feed([("text", "hello E")], final=False) == [("text", "hell")]
    assert stop.feed([("text", "N")], final=True) == [("text", "o EN")]  # no stop string came


def test_an_event_of_k_tokens_is_k_steps_with_the_finish_on_the_last() -> None:
    from ext_proc.derender.pipeline import per_token

    entries = [{"token_id": t, "logprob": -1.0, "top_logprobs": []} for t in (7, 8, 9)]
    choice = {
        "index": 1,
        "token_ids": [7, 8, 9],
        "finish_reason": "stop",
        "stop_reason": 9,
        "logprobs": {"content": entries},
    }
    pieces = per_token({"request_id": "r", "choices": [choice]})
    assert pieces is not None
    assert [p["choices"][0]["token_ids"] for p in pieces] == [[7], [8], [9]]
    assert [p["choices"][0]["logprobs"]["content"][0]["token_id"] for p in pieces] == [7, 8, 9]
    assert [(p["choices"][0]["finish_reason"], p["choices"][0]["stop_reason"]) for p in pieces] == [
        (None, None),
        (None, None),
        ("stop", 9),
    ]
    assert all(p["request_id"] == "r" and p["choices"][0]["index"] == 1 for p in pieces)
    assert per_token({"choices": [{"index": 0, "token_ids": [5]}]}) is None  # nothing to split
    assert per_token({"choices": [], "usage": {"completion_tokens": 3}}) is None
    for garbage in ({"choices": 5}, {"choices": [3]}, {"choices": [{"token_ids": 3}]}):
        assert per_token(garbage) is None  # the session says it is no generate event
