"""How many tokens an engine event carries: vLLM's per-request `stream_interval` (0.32).

Every engine event costs the processor one ext_proc message and reply (~100 µs of grpc.aio
at engine pace, `../shared/docs/extproc-transport.md`), whatever it carries. An engine asked
for `stream_interval: k` sends its first and last outputs at once and the rest every k tokens,
so a stream costs about 1/k of the messages; derender treats an event of k ids as the k
steps native serving would have made (the text, tool calls, logprobs and usage are the same:
`tests/unit/test_derender_fuzz.py`, the conformance list at k = 4 and 16).

`auto` keeps k = 1 (native's own chunking) while the processor keeps up, and doubles it for
each doubling of the event-loop lag over `LAG_STEP_MS`, up to `AUTO_MAX`: when the loop runs
late every stream already waits that long for its next message, and fewer messages is what
makes it run on time again. k is fixed per engine leg (the body is sent once).
"""

from __future__ import annotations

from typing import Literal

AUTO_MAX = 16
LAG_STEP_MS = 2.0  # event-loop lag at which auto leaves k = 1


def stream_interval(setting: int | Literal["auto"], lag_ms: float) -> int:
    """The k a new engine leg asks for, by the config and the loop's recent lag."""
    if setting != "auto":
        return setting
    k = 1
    while k < AUTO_MAX and lag_ms >= LAG_STEP_MS * k:
        k *= 2
    return k
