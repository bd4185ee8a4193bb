"""KV cache events from each engine (vLLM's ZMQ publisher) into the scheduler's prefix index.

Per instance: a SUB socket on the engine's `endpoint`, and first a replay from its ROUTER
`replay_endpoint` of every batch it still buffers (a processor started after the traffic
learns the same index), again after a gap in the sequence numbers. Each message is
`topic, seq (8 bytes big-endian), msgpack [ts, [events], dp_rank]`; events are tagged maps
(`type`: BlockStored, BlockRemoved, AllBlocksCleared) whose block hashes are the engines'
own (`scheduler/kv_block_hash.py`). While connected, the instance is event-fed
(`scheduler/kv_events.py` says when it lags and falls back to routing-time records);
reconnects after a failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ext_proc.config import KvEventsEndpoint
from scheduler import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, Scheduler

log = logging.getLogger("tito.kv_events")
END_SEQ = -1
WATCH_MS = 500  # how often a silent stream is checked for lag
_LOW_64 = (1 << 64) - 1


class ReplayFailed(Exception):
    pass


def decode_batch(payload: bytes) -> list[KvEvent]:
    """One published batch as scheduling input (events of other kinds are skipped)."""
    batch = msgspec.msgpack.decode(payload)
    events: list[KvEvent] = []
    for event in batch[1] if isinstance(batch, list) and len(batch) > 1 else ():
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "BlockStored":
            events.append(BlockStored(tuple(_hash(h) for h in event["block_hashes"]), event.get("block_size") or 0))
        elif kind == "BlockRemoved":
            events.append(BlockRemoved(tuple(_hash(h) for h in event["block_hashes"])))
        elif kind == "AllBlocksCleared":
            events.append(AllBlocksCleared())
    return events


def _hash(value: Any) -> int:
    """Engines send the low 64 bits as an int; bytes when configured otherwise."""
    return value if isinstance(value, int) else int.from_bytes(value, "big") & _LOW_64


class KvEventSubscriber:
    def __init__(
        self,
        address: str,
        endpoint: KvEventsEndpoint,
        scheduler: Scheduler,
        block_size: int,
        timeout_s: float = 5.0,
    ) -> None:
        self.address = address
        self._endpoint = endpoint
        self._scheduler = scheduler
        self._block_size = block_size
        self._mismatch_logged = False
        self._fed = True  # what the last _watch saw
        self._timeout_ms = int(timeout_s * 1000)
        self._context = zmq.asyncio.Context.instance()
        self.last_seq = END_SEQ

    async def run(self) -> None:
        while True:
            try:
                await self._session()
            except (zmq.ZMQError, ReplayFailed, msgspec.DecodeError) as exc:
                log.warning("KV events of %s: %s; routing-time records meanwhile", self.address, exc)
            finally:
                self._scheduler.feeds.subscribed(self.address, live=False)
            await asyncio.sleep(1.0)

    async def _session(self) -> None:
        sub = self._context.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self._endpoint.topic.encode())
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(self._endpoint.endpoint)
            await self._replay(0)  # what the engine published before this subscription
            self._scheduler.feeds.subscribed(self.address, live=True)
            log.info("KV events of %s: subscribed (replayed up to seq %d)", self.address, self.last_seq)
            while True:
                if await sub.poll(WATCH_MS):
                    _, seq_bytes, payload = await sub.recv_multipart()
                    seq = int.from_bytes(seq_bytes, "big", signed=True)
                    if seq > self.last_seq + 1:  # missed some: the replay buffer has them
                        await self._replay(self.last_seq + 1)
                    if seq > self.last_seq:
                        self._apply(seq, payload)
                self._watch()
        finally:
            sub.close()

    def _watch(self) -> None:
        """Log when the instance's stream starts lagging (its requests are recorded at routing
        time meanwhile: /debug/state says `routing`) and when events catch up again."""
        fed = self._scheduler.feeds.event_fed(self.address, time.monotonic())  # the planner's clock
        if fed != self._fed:
            self._fed = fed
            if fed:
                log.info("KV events of %s: flowing again; the index follows the engine", self.address)
            else:
                log.warning(
                    "KV events of %s: no event %g s after a request was sent; routing-time records meanwhile",
                    self.address,
                    self._scheduler.feeds.lag_s,
                )

    async def _replay(self, start: int) -> None:
        dealer = self._context.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self._endpoint.replay_endpoint)
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not await dealer.poll(self._timeout_ms):
                    raise ReplayFailed(f"no replay answer from {self._endpoint.replay_endpoint}")
                _, _, seq_bytes, payload = await dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return
                if seq > self.last_seq:
                    self._apply(seq, payload)
        finally:
            dealer.close()

    def _apply(self, seq: int, payload: bytes) -> None:
        events = decode_batch(payload)
        self._check_block_size(events)
        self._scheduler.kv_events(self.address, events)
        self.last_seq = seq

    def _check_block_size(self, events: list[KvEvent]) -> None:
        """Blocks of another size never match the gateway's hashes: say so once, loudly."""
        sizes = {e.block_size for e in events if isinstance(e, BlockStored)} - {0, self._block_size}
        if sizes and not self._mismatch_logged:
            self._mismatch_logged = True
            log.error(
                "KV events of %s: the engine's blocks hold %s tokens, pools[].block_size says %d;"
                " no prompt can match them (set block_size to the engine's)",
                self.address,
                sorted(sizes)[0],
                self._block_size,
            )
