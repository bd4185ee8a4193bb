"""Event-loop lag: how late the processor's loop runs a timer.

Every stream of a processor shares one asyncio loop, so any CPU work on it (derender steps,
JSON, protobufs) delays every other stream's next message. A timer that should fire every
`interval_s` and fires late measures exactly that delay; `/debug/state` and `/metrics`
report it, and `tests/bench/processor_bench.py` prints it under full load.
"""

from __future__ import annotations

import asyncio
from collections import deque
from itertools import islice
from typing import Any


class LoopLag:
    def __init__(self, interval_s: float = 0.05, window: int = 1200) -> None:
        self._interval = interval_s
        self._samples: deque[float] = deque(maxlen=window)  # the last minute at 50 ms
        self.max_ms = 0.0
        self.loop = ""  # the loop's implementation: "uvloop" or "asyncio" (`processor.event_loop`)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.loop = type(loop).__module__.split(".")[0]
        while True:
            start = loop.time()
            await asyncio.sleep(self._interval)
            lag_ms = max(loop.time() - start - self._interval, 0.0) * 1000
            self._samples.append(lag_ms)
            self.max_ms = max(self.max_ms, lag_ms)

    def recent_ms(self, samples: int = 20) -> float:
        """The worst lag of the last `samples` ticks (a second at 50 ms): what a stream
        starting now is likely to see."""
        return max(islice(reversed(self._samples), samples), default=0.0)

    def snapshot(self) -> dict[str, Any]:
        ordered = sorted(self._samples)
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] if ordered else 0.0
        return {"p99_ms": round(p99, 2), "max_ms": round(self.max_ms, 2), "samples": len(ordered), "loop": self.loop}
