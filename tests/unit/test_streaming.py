"""SSE framing as the processor sees it: events cut anywhere by the network."""

from __future__ import annotations

import pytest

from ext_proc.derender.streaming import SSEFramer

STREAM = b'data: {"a":1}\n\ndata:{"b":2}\r\n\r\n: comment\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 64])
def test_events_split_across_chunks_are_reassembled(size: int) -> None:
    framer = SSEFramer()
    out: list[bytes] = []
    for i in range(0, len(STREAM), size):
        out += framer.feed(STREAM[i : i + size])
    assert out == [b'{"a":1}', b'{"b":2}', b"[DONE]"]
    assert framer.flush() == []


def test_cr_only_line_endings_and_multiline_data() -> None:
    framer = SSEFramer()
    assert framer.feed(b"data: x\rdata: y\r\rdata: z\r\r") == [b"x\ny", b"z"]


def test_unterminated_last_event_is_flushed() -> None:
    framer = SSEFramer()
    assert framer.feed(b'data: {"last":true}') == []
    assert framer.flush() == [b'{"last":true}']


def test_tail_holds_only_the_unfinished_event() -> None:
    framer = SSEFramer()
    for _ in range(1000):
        framer.feed(b'data: {"x":1}\n\n')
    framer.feed(b"data: partial")
    assert framer._tail == b"data: partial"
