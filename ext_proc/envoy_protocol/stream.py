"""The life of one ext_proc gRPC stream: a reader task feeds Envoy's messages to the
exchange, whose replies go straight to the call's outbox (the processor's own server writes
them as they are put), so the processor can also send messages between Envoy's
(processor-owned work); `done` says when the call may end; `aclose` cancels and awaits every
task the stream started, then lets the exchange release what it holds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from ext_proc.envoy_protocol.h2_server import Outbox
from ext_proc.errors import GatewayError
from ext_proc.observability.request import RequestRecord
from protos.stubs import ext_proc_pb

log = logging.getLogger("tito.exchange")
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"  # the gRPC method's path
Replies = AsyncIterator[ext_proc_pb.ProcessingResponse]


class QueuedOutbox:
    """An outbox for a transport whose write is a coroutine (grpc.aio's `context.write`): replies
    wait in a queue that `drain` writes out, in order, until the stream is done."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[ext_proc_pb.ProcessingResponse | None] = asyncio.Queue()

    def put(self, message: ext_proc_pb.ProcessingResponse | None) -> None:
        self._queue.put_nowait(message)

    async def flush(self) -> None:
        await self._queue.join()

    async def drain(self, write: Callable[[ext_proc_pb.ProcessingResponse], Awaitable[None]]) -> None:
        """Write replies until the end mark (`put(None)`)."""
        while (reply := await self._queue.get()) is not None:
            await write(reply)
            self._queue.task_done()
        self._queue.task_done()


class EnvoyStream:
    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self._outbox: Outbox | None = None
        # Set when the call may end: Envoy's side is over and nothing of ours is left to send.
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        # A processor-owned answer ends the call itself (`end`), whenever Envoy's side ends.
        self.ends_itself = False
        self._reader_done = False
        # Replies ending an answer from outside (`end_now`) with a body piece before Envoy has
        # streamed any response body: Envoy would call the reply spurious and reset the
        # client's stream, so they wait for its first body message. None: it streams one.
        self._before_body: list[ext_proc_pb.ProcessingResponse] | None = []

    def on_message(self, message: ext_proc_pb.ProcessingRequest) -> Replies:
        raise NotImplementedError

    def on_bug(self) -> list[ext_proc_pb.ProcessingResponse]:
        """The replies after an unexpected exception (a processor bug)."""
        return []

    def interrupt(self, error: GatewayError) -> list[ext_proc_pb.ProcessingResponse]:
        """The replies that end the answer now with `error`."""
        return []

    def end_now(self, error: GatewayError) -> bool:
        """The answer ends now with `error`, from outside the stream (the drain deadline, flow
        control's eviction); False: the stream had no answer left to end."""
        if self._closed or self.answered:
            return False
        for reply in self.interrupt(error):
            if reply.HasField("response_body") and self._before_body is not None:
                self._before_body.append(reply)
            else:
                self.put(reply)
        return True

    def put(self, reply: ext_proc_pb.ProcessingResponse) -> None:
        """A reply to Envoy, after every one put before it."""
        assert self._outbox is not None, "the stream has not started"
        self._outbox.put(reply)
        self.record.replied()

    def release(self) -> None:
        """Give back what the stream holds (after every task it started has ended)."""

    @property
    def answered(self) -> bool:
        """The processor gave its final answer: nothing Envoy sends can change it."""
        return False

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self, messages: AsyncIterator[ext_proc_pb.ProcessingRequest], outbox: Outbox) -> None:
        self._outbox = outbox
        self.spawn(self._read(messages))

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def send(self, reply: ext_proc_pb.ProcessingResponse) -> None:
        """A message of the processor's own, between Envoy's; returns once gRPC has taken
        every message put so far (backpressure for processor-owned streams)."""
        self.put(reply)
        assert self._outbox is not None
        await self._outbox.flush()

    def end(self) -> None:
        """A processor-owned answer is complete: the call ends when Envoy ends its side (ending
        it from here raced Envoy's handling of the last messages: clients then waited for an
        end that never came), or now if Envoy already has."""
        self.ends_itself = False
        if self._reader_done:
            self._finish()

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    async def _read(self, messages: AsyncIterator[ext_proc_pb.ProcessingRequest]) -> None:
        try:
            async for message in messages:
                if message.HasField("response_body") and self._before_body is not None:
                    held, self._before_body = self._before_body, None
                    for reply in held:  # (its handler is done: nothing else answers the message)
                        self.put(reply)
                try:
                    async for reply in self.on_message(message):
                        self.put(reply)
                except Exception:
                    log.exception("processor error on %s", message.WhichOneof("request"))
                    for reply in self.on_bug():
                        self.put(reply)
                if self.answered:
                    # End the call from this side: Envoy may keep it open while it drains a
                    # client's upload, and the stream's resources would wait with it.
                    break
        finally:
            self._reader_done = True
            if not self.ends_itself:
                self._finish()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        try:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            # Even when this wait is itself cancelled (gRPC tears the call's task down):
            # what the stream holds goes back exactly once.
            self.release()
