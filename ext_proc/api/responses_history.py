"""A stored conversation carried into its next turn (`previous_response_id`), as native vLLM
with its store carries it, through render's stateless Responses route.

Native (`OpenAIServingResponses._render_resolved_response_inputs`) renders a follow-up from
three parts, with vLLM's `construct_input_messages`: the chat messages the previous turn was
rendered from (its system message dropped: instructions do not carry over), the text of the
previous answer's output messages (its reasoning and tool calls are not carried), and the new
input's messages. Render's stateless route refuses `previous_response_id` but renders any list
of input items, so the gateway makes the items whose messages are exactly those
(`history_items`), checks that vLLM's own function turns them back into the same messages, and
has render render them: the same template, the same ids.

One shape has no items: an assistant message that starts with a tool call right after another
assistant message (e.g. a follow-up whose input echoes a `function_call` after an answer with
text): vLLM merges such items into the message before. That request is refused with a clear
400; sending the history inline (no `previous_response_id`) serves it.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from ext_proc.errors import GatewayError

Message = dict[str, Any]

INEXPRESSIBLE = (
    "this conversation cannot be continued by previous_response_id through the gateway: a tool call that "
    "follows an assistant message with no message between them; send the conversation as input instead"
)
# Input item id prefixes, as OpenAI's ids read (`GET /v1/responses/{id}/input_items`)
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def turn_messages(
    client: Any, previous_messages: list[Message] | None, previous_output: list[Any] | None
) -> list[Message]:
    """The chat messages this turn is rendered from (native keeps them for the next turn)."""
    from vllm.entrypoints.openai.responses.utils import construct_input_messages

    messages: list[Message] = construct_input_messages(
        request_instructions=client.instructions,
        request_input=client.input,
        prev_msg=previous_messages,  # type: ignore[arg-type]  # (vLLM's message dicts, as JSON made them)
        prev_response_output=previous_output,
    )
    return messages


def history_items(messages: list[Message], instructions: str | None, model: str) -> list[Any]:
    """Input items that vLLM turns into exactly `messages` (after the system message it makes
    of `instructions`); a GatewayError (400) when none do."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages

    body = messages[1:] if instructions else messages  # (the first: instructions' system message)
    items = [item for message in body for item in _items(message)]
    check = ResponsesRequest.model_validate({"model": model, "input": items, "instructions": instructions})
    again = construct_input_messages(request_instructions=instructions, request_input=check.input)
    if orjson.loads(dumps(again)) != orjson.loads(dumps(messages)):  # (key order aside)
        raise GatewayError(400, INEXPRESSIBLE, param="previous_response_id", kind="invalid_request_error")
    return items


def _items(message: Message) -> list[Any]:
    """The items of one message, in the order vLLM merges them back into one assistant message:
    text first (a new message only when it has text), then reasoning, then tool calls."""
    role = message.get("role")
    if role == "tool":
        return [
            {"type": "function_call_output", "call_id": message.get("tool_call_id"), "output": message.get("content")}
        ]
    if role != "assistant":
        return [message]  # user, system, developer: vLLM passes these through as they are
    items: list[Any] = []
    if message.get("content") is not None:
        items.append({"role": "assistant", "content": message["content"]})
    if "reasoning" in message:
        text = message["reasoning"] or ""
        items.append({"type": "reasoning", "id": _id("reasoning"), "summary": [], "content": [_reasoning(text)]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(
            {
                "type": "function_call",
                "call_id": call["id"],
                "name": function["name"],
                "arguments": function["arguments"],
            }
        )
    return items


def _reasoning(text: str) -> dict[str, str]:
    return {"type": "reasoning_text", "text": text}


def listed_items(client: Any) -> list[dict[str, Any]]:
    """The turn's input items as OpenAI lists them (`input_items`): each with an id, a text
    input as the user message it is."""
    raw = client.input
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    listed = []
    for item in orjson.loads(dumps(raw)):
        kind = item.get("type") or "message"
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        listed.append({"id": item.get("id") or _id(kind), "type": kind, **item})
    return listed


def _id(kind: str) -> str:
    return f"{_ID_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}"


def dumps(value: Any) -> bytes:
    """JSON of messages or items that may hold vLLM's or OpenAI's pydantic objects."""
    return orjson.dumps(value, default=_plain)


def _plain(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", exclude_none=True)
    raise TypeError(f"not JSON: {type(value).__name__}")
