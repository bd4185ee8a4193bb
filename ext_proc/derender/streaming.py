"""Server-sent events: framing that survives events split across body chunks."""

from __future__ import annotations

import re

DONE = b"[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"
# An event ends at a blank line; LF, CR and CRLF line endings are all legal SSE.
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r|\r\n\n|\n\r\n")
_LINE_SPLIT = re.compile(rb"\r\n|\r|\n")


class SSEFramer:
    """Feeds raw body bytes, yields the `data` payload of each complete event.

    Only the unfinished tail is kept between calls, so the work per chunk is proportional
    to the chunk, not to the length of the stream.
    """

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buffer = self._tail + chunk if self._tail else chunk
        payloads: list[bytes] = []
        start = 0
        for match in _EVENT_END.finditer(buffer):
            data = _event_data(buffer[start : match.start()])
            if data is not None:
                payloads.append(data)
            start = match.end()
        self._tail = buffer[start:]
        return payloads

    def flush(self) -> list[bytes]:
        """The last event when the stream ended without a blank line."""
        tail, self._tail = self._tail, b""
        data = _event_data(tail) if tail.strip() else None
        return [data] if data is not None else []


def _event_data(event: bytes) -> bytes | None:
    lines = []
    for line in _LINE_SPLIT.split(event):
        if line.startswith(b"data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(lines) if lines else None


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"
