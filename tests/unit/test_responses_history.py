"""A stored conversation carried into its next turn: the input items render gets make exactly
the chat messages native vLLM renders a follow-up from; and the stored-response routes
(`ext_proc/api/conversations.py`) against a real SQLite store, tenants kept apart."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from ext_proc.api.conversation_store import SqliteResponseStore
from ext_proc.api.conversations import Conversations, StoredResponse
from ext_proc.api.responses_history import history_items, listed_items, turn_messages
from ext_proc.errors import GatewayError

ANSWER = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}],
}
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
CALL_OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "20C"}
REASONING = {"type": "reasoning", "id": "r", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]}


def _client(body: dict[str, Any]) -> Any:
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    return ResponsesRequest.model_validate({"model": "tiny", **body})


def _output(*items: dict[str, Any]) -> list[Any]:
    from vllm.entrypoints.openai.responses.protocol import ResponsesResponse

    body = {"id": "resp_1", "created_at": 0, "model": "tiny", "object": "response", "output": list(items)}
    body.update(status="completed", parallel_tool_calls=True, tool_choice="auto", tools=[], temperature=0.0)
    body.update(top_p=1.0, background=False, max_output_tokens=8, service_tier="auto", truncation="disabled")
    return list(ResponsesResponse.model_validate(body).output)


def _rendered_from(items: list[Any], instructions: str | None) -> Any:
    """The messages render makes of these items (vLLM's own function), as JSON."""
    client = _client({"input": items, "instructions": instructions})
    return orjson.loads(orjson.dumps(turn_messages(client, None, None), default=lambda o: o.model_dump()))


@pytest.mark.parametrize(
    ("previous", "output", "new", "instructions"),
    [
        ([{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}], [ANSWER], "more", "be brief"),
        ([{"role": "user", "content": "weather?"}], [], [CALL_OUTPUT], None),
        (
            [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            [ANSWER],
            [REASONING, {"role": "assistant", "content": "ans"}, CALL],
            None,
        ),
        ([{"role": "developer", "content": "dev"}], [ANSWER, REASONING], [{"role": "user", "content": "q"}], "i"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "reasoning": "r", "content": "b"}], [], "c", None),
    ],
    ids=["instructions-not-carried", "tool-output", "reasoning-text-call", "developer", "stored-reasoning"],
)
def test_the_items_render_gets_make_the_messages_native_renders(
    previous: list[dict[str, Any]], output: list[dict[str, Any]], new: Any, instructions: str | None
) -> None:
    client = _client({"input": new, "instructions": instructions})
    messages = turn_messages(client, previous, _output(*output) if output else None)
    native = orjson.loads(orjson.dumps(messages, default=lambda o: o.model_dump()))
    assert _rendered_from(history_items(messages, instructions, "tiny"), instructions) == native


def test_a_tool_call_right_after_an_answer_has_no_items_and_is_refused() -> None:
    client = _client({"input": [CALL, CALL_OUTPUT]})
    messages = turn_messages(client, [{"role": "user", "content": "weather?"}], _output(ANSWER))
    with pytest.raises(GatewayError) as refused:
        history_items(messages, None, "tiny")
    assert refused.value.status == 400 and refused.value.param == "previous_response_id"


def test_input_items_are_listed_with_ids_a_text_input_as_a_user_message() -> None:
    (text,) = listed_items(_client({"input": "hi"}))
    assert text["type"] == "message" and text["role"] == "user" and text["id"].startswith("msg_")
    assert text["content"] == [{"type": "input_text", "text": "hi"}]
    listed = listed_items(_client({"input": [{"role": "user", "content": "a"}, CALL_OUTPUT]}))
    assert [item["type"] for item in listed] == ["message", "function_call_output"]
    assert listed[1]["id"].startswith("fco_") and listed[1]["output"] == "20C"


def _stored(response_id: str, tenant: str | None, status: str = "completed") -> StoredResponse:
    items = orjson.dumps([{"id": f"msg_{n}", "type": "message", "role": "user", "content": []} for n in range(3)])
    body = orjson.dumps({"id": response_id, "status": status})
    return StoredResponse(response_id, tenant, body, b"[]", items, 1e12)  # (created far in the future: never expires)


def test_stored_routes_answer_only_their_tenant(tmp_path: Path) -> None:
    async def run() -> None:
        conversations = Conversations(SqliteResponseStore(str(tmp_path / "c.sqlite3"), 3600, 100))
        try:
            await conversations.keep(_stored("resp_a", "alpha"))

            async def ask(handler: str, tenant: str | None, **query: str) -> tuple[int, Any]:
                params = {key: [value] for key, value in query.items()}
                status, body = await conversations.answer(handler, {"response_id": "resp_a"}, params, tenant)
                return status, orjson.loads(body)

            assert (await ask("responses_retrieve", "alpha"))[1]["id"] == "resp_a"
            for handler in ("responses_retrieve", "responses_input_items", "responses_cancel", "responses_delete"):
                status, body = await ask(handler, "beta")  # another tenant's: unknown
                assert status == 404 and body["error"]["message"] == "Response with id 'resp_a' not found."
            status, body = await ask("responses_cancel", "alpha")
            assert status == 400 and body["error"]["message"] == "Cannot cancel a synchronous response."
            status, page = await ask("responses_input_items", "alpha", limit="2")
            assert [i["id"] for i in page["data"]] == ["msg_2", "msg_1"] and page["has_more"] is True
            status, page = await ask("responses_input_items", "alpha", order="asc", after="msg_0")
            assert [i["id"] for i in page["data"]] == ["msg_1", "msg_2"] and page["has_more"] is False
            assert (await ask("responses_input_items", "alpha", order="sideways"))[0] == 400
            assert await ask("responses_delete", "alpha") == (
                200,
                {"id": "resp_a", "object": "response", "deleted": True},
            )
            assert (await ask("responses_retrieve", "alpha"))[0] == 404
        finally:
            await conversations.close()

    asyncio.run(run())


def test_without_a_store_every_id_is_unknown() -> None:
    status, body = asyncio.run(Conversations().answer("responses_retrieve", {"response_id": "resp_x"}, {}, None))
    assert status == 404 and orjson.loads(body)["error"]["param"] == "response_id"


class _Down:
    """A store that cannot be reached (Redis down, a disk gone)."""

    async def put(self, stored: StoredResponse) -> None:
        raise ConnectionError("down")

    async def get(self, response_id: str) -> StoredResponse | None:
        raise ConnectionError("down")

    async def delete(self, response_id: str) -> bool:
        raise ConnectionError("down")

    async def close(self) -> None:
        pass


def test_a_store_that_is_down_is_a_503_and_a_lost_write_is_counted_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    conversations, seen = Conversations(_Down()), []
    conversations.on_outcome = lambda op, outcome: seen.append((op, outcome))

    async def run() -> tuple[int, bytes]:
        await conversations.keep(_stored("resp_secret", "alpha"))  # the answer still goes out
        return await conversations.answer("responses_retrieve", {"response_id": "resp_secret"}, {}, "alpha")

    status, body = asyncio.run(run())
    assert status == 503 and orjson.loads(body)["error"]["code"] == "store_unavailable"
    assert seen == [("put", "error"), ("get", "error")]
    assert "ConnectionError" in caplog.text and "alpha" not in caplog.text
