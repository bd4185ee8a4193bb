"""Conformance: the gateway's OpenAI answer must equal the engine's native OpenAI answer.

For the same engine, seed and request, vLLM's own `/v1/chat/completions` and `/v1/completions`
are the reference: whatever render → token-only generate → derender hands a client must be what
the engine would have answered itself, field by field. Each case is a request (data, not code)
run first against the native endpoint, whose answer must show the feature the case is about
(otherwise the case proves nothing and is reported `BROKEN CASE`), then against the gateway.
Both answers are normalized per choice (streams concatenated, tool-call ids reduced to
"present and stable", ids/timestamps dropped) and compared; streams are also read as raw SSE
to check the framing a client relies on (one `data: [DONE]` at the end, one `id`, the chunk
`object`). An error is an answer too: its status and error object (type, message, param,
code) are compared, in the body or as a stream's in-band error event.

`tito conformance --gateway URL --native URL --model NAME [--only SUBSTRING] [--api ...]` prints
one line per case and exits non-zero on any difference; the e2e tests run the same cases. The
Anthropic Messages cases are `messages.py`'s, OpenAI Responses cases
`responses.py`'s.
"""
