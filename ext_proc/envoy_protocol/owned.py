"""The processor-owned answer (fan-out, relay): no upstream through Envoy; the processor runs
the engine streams (`legs/fanout.py`) and answers the held request-headers message with a
streamed local response (envoy-ext-proc.md §5): headers once every engine stream is
established, then the merged SSE bytes as they come, each sent only when gRPC took the one
before (a slow client makes the producers wait, nothing piles up here)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

from ext_proc.derender.streaming import DONE_EVENT, SSEFramer, sse_event
from ext_proc.envoy_protocol import messages as msg
from ext_proc.envoy_protocol.stream import EnvoyStream, Replies
from ext_proc.errors import GatewayError
from ext_proc.legs.fanout import FanOut
from ext_proc.legs.relay import OwnedContext
from ext_proc.observability.request import RequestRecord
from ext_proc.planning.plan import Owned, conversion
from ext_proc.services import Services

SSE = "text/event-stream"
log = logging.getLogger("tito.fanout")


class OwnedAnswer:
    def __init__(self, stream: EnvoyStream, services: Services, plan: Owned, record: RequestRecord) -> None:
        config = services.config
        context = OwnedContext(
            services.http,
            services.planner,
            services.derender,
            config.reschedule,
            config.listener.stream_idle_timeout_s,
            config.processor.max_response_bytes,
            services.codec,
            services.triggers,
            services.tokenizer,
        )
        self._stream = stream
        self._record = record
        self._services = services
        self._plan = plan
        self.fanout = FanOut(context, plan, config.processor.owned_queue_depth, config.model.served_name)
        self.streaming = False  # the client has headers and the writer task owns the rest
        # a Messages or Responses request: the inner answer converted as native converts it
        self._conversion = conversion(plan)

    async def replies(self) -> Replies:
        try:
            await self.fanout.establish()
            if self._plan.tokenized.stream:
                self.streaming = self._stream.ends_itself = True
                yield msg.local_response_headers(200, SSE, self._record)
                self._stream.spawn(self._write())
                return
            status, body = 200, await self.fanout.whole()
        except GatewayError as error:
            status, body = error.status, error.body
            if self._conversion is not None:
                body = self._conversion.error(status, body)
        finally:
            if not self.streaming:
                await self._close()
        if self._conversion is not None and status == 200:
            status, body = self._conversion.whole(body)
            await self._conversion.finished()
        for reply in msg.local_response(status, body, self._record):
            yield reply

    async def _write(self) -> None:
        complete = False
        converter = self._conversion.stream() if self._conversion is not None else None
        framer = SSEFramer()
        try:
            async with aclosing(self.fanout.stream()) as chunks:
                async for data in chunks:
                    if converter is not None:
                        data = converter.convert(framer.feed(data))
                    if data:
                        await self._stream.send(msg.local_response_body(data, False, self._record))
            complete = True
            tail = b""
            if (error := self.fanout.interrupted) is not None:  # the gateway's own end
                if converter is None:  # a chat or completions stream: its error event as is
                    tail = sse_event(error.body) + DONE_EVENT
                else:
                    tail = converter.ended(error.status, error.body)
            elif converter is not None and self._conversion is not None:
                tail = converter.convert(framer.flush(), end=True)
                await self._conversion.finished()
            await self._stream.send(msg.local_response_body(tail, True, self._record))
        except asyncio.CancelledError:
            if not complete:  # the client left (Envoy reset the call) before the end
                open_streams = sum(prompt.streaming for prompt in self.fanout.prompts)
                log.info("client left %s; closing %d engine streams", self._plan.tokenized.request_id, open_streams)
            raise
        finally:
            if converter is not None:
                converter.close()
            process = self._services.process
            process.owned_queue_depth_max = max(process.owned_queue_depth_max, self.fanout.queue_depth_max)
            process.relays += sum(prompt.attempts for prompt in self.fanout.prompts)
            self._stream.end()
            await self._close()

    async def _close(self) -> None:
        """Every engine stream closed, even when gRPC cancels the closing call's tasks once
        more (its own cancellation reaches them through `aclose`)."""
        await asyncio.shield(self.fanout.aclose())
