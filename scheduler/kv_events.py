"""The engines' KV cache events as scheduling input (what the subscriber in
`ext_proc/kv_events.py` decodes), and which instances they keep up to date.

An instance is event-fed once its engine's event stream is subscribed; its index entries
then come from `BlockStored`/`BlockRemoved`/`AllBlocksCleared` only (what the engine holds,
evictions and other gateways' traffic included). It falls back to routing-time recording
while its stream lags: a request with full blocks was committed to it `lag_s` ago and no
event has come since. (A request served wholly from blocks the engine already held announces
nothing, as vLLM re-announces reused blocks only when a request asks: that too reads as a lag,
and the instance is event-fed again with its next event; routing-time records are right
meanwhile.) Pure: inputs in, state out; the caller brings the clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    block_size: int = 0  # as the engine announced it (0: not said)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventFeeds:
    def __init__(self, lag_s: float) -> None:
        self.lag_s = lag_s
        self._subscribed: set[str] = set()
        self._waiting: dict[str, float] = {}  # instance -> the oldest commit no event followed yet

    def subscribed(self, address: str, live: bool) -> None:
        """The I/O side connected to (or lost) the instance's event stream."""
        if live:
            self._subscribed.add(address)
        else:
            self._subscribed.discard(address)
            self._waiting.pop(address, None)

    def forget(self, address: str) -> None:
        self.subscribed(address, False)

    def committed(self, address: str, now: float) -> None:
        if address in self._subscribed:
            self._waiting.setdefault(address, now)

    def received(self, address: str) -> None:
        self._waiting.pop(address, None)

    def event_fed(self, address: str, now: float) -> bool:
        if address not in self._subscribed:
            return False
        since = self._waiting.get(address)
        return since is None or now - since < self.lag_s
