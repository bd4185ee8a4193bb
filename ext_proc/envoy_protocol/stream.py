"""The life of one ext_proc gRPC stream: a reader task feeds Envoy's messages to the
exchange, whose replies go to an outbox the gRPC method drains, so the processor can also
send messages between Envoy's (processor-owned work); `aclose` cancels and awaits every task
the stream started, then lets the exchange release what it holds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from ext_proc.errors import GatewayError
from protos.stubs import ext_proc_pb

log = logging.getLogger("tito.exchange")
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"  # the gRPC method's path
Replies = AsyncIterator[ext_proc_pb.ProcessingResponse]


class EnvoyStream:
    def __init__(self) -> None:
        self.outbox: asyncio.Queue[ext_proc_pb.ProcessingResponse | None] = asyncio.Queue()
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
                self.outbox.put_nowait(reply)
        return True

    def release(self) -> None:
        """Give back what the stream holds (after every task it started has ended)."""

    @property
    def answered(self) -> bool:
        """The processor gave its final answer: nothing Envoy sends can change it."""
        return False

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self, messages: AsyncIterator[ext_proc_pb.ProcessingRequest]) -> None:
        self.spawn(self._read(messages))

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def send(self, reply: ext_proc_pb.ProcessingResponse) -> None:
        """A message of the processor's own, between Envoy's; returns once gRPC has taken
        every message queued so far (backpressure for processor-owned streams)."""
        self.outbox.put_nowait(reply)
        await self.outbox.join()

    def end(self) -> None:
        """A processor-owned answer is complete: the call ends when Envoy ends its side (ending
        it from here raced Envoy's handling of the last messages: clients then waited for an
        end that never came), or now if Envoy already has."""
        self.ends_itself = False
        if self._reader_done:
            self.outbox.put_nowait(None)

    async def _read(self, messages: AsyncIterator[ext_proc_pb.ProcessingRequest]) -> None:
        try:
            async for message in messages:
                if message.HasField("response_body") and self._before_body is not None:
                    held, self._before_body = self._before_body, None
                    for reply in held:  # (its handler is done: nothing else answers the message)
                        self.outbox.put_nowait(reply)
                try:
                    async for reply in self.on_message(message):
                        self.outbox.put_nowait(reply)
                except Exception:
                    log.exception("processor error on %s", message.WhichOneof("request"))
                    for reply in self.on_bug():
                        self.outbox.put_nowait(reply)
                if self.answered:
                    # End the call from this side: Envoy may keep it open while it drains a
                    # client's upload, and the stream's resources would wait with it.
                    break
        finally:
            self._reader_done = True
            if not self.ends_itself:
                self.outbox.put_nowait(None)

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
