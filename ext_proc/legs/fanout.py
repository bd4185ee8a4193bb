"""Fan-out/merge (RFC 多 prompt 流式 Completions): every prompt of a batch on its own engine
stream, lease and instance, one client response (reference-systems.md §1.4).

Every stream is established (200 from its engine) before the client's response starts. Then,
streaming: each prompt's producer derenders its stream in order into one bounded queue, so
prompts run concurrently and a slow client makes the producers wait (engine backpressure)
instead of growing memory; chunks carry the global choice index `prompt_index * n + i`; one
usage chunk with the sums, exactly one `[DONE]`. Non-streaming: every answer read
concurrently, derendered per prompt and merged in prompt order. The first failure anywhere
cancels every sibling, closes their engine streams (the engines abort) and ends the client's
stream with an error event and `[DONE]`. A single-prompt stream is the same with a batch of
one (relay: `relay.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import orjson

from ext_proc.derender.model import fingerprinted
from ext_proc.derender.streaming import DONE_EVENT, sse_event
from ext_proc.errors import GatewayError
from ext_proc.legs.beam import BeamSearch
from ext_proc.legs.relay import OwnedContext, PromptStream
from ext_proc.observability.request import current
from ext_proc.planning.plan import Owned

log = logging.getLogger("tito.fanout")


@dataclass(frozen=True)
class _Interruption:
    error: GatewayError  # the gateway ends the answer (an eviction, the drain deadline)


_Item = bytes | GatewayError | _Interruption | None  # SSE bytes, a prompt's failure, the gateway's end, a prompt's end


class FanOut:
    def __init__(self, ctx: OwnedContext, plan: Owned, queue_depth: int, served_name: str) -> None:
        self._ctx = ctx
        self._plan = plan
        self._served_name = served_name
        merged = len(plan.legs) > 1
        self.prompts: list[PromptStream | BeamSearch] = [
            BeamSearch(ctx, plan, i) if plan.tokenized.request.beam_search else PromptStream(ctx, plan, i, merged)
            for i in range(len(plan.legs))
        ]
        self._queue: asyncio.Queue[_Item] = asyncio.Queue(queue_depth)
        self.queue_depth_max = 0
        self._producers: list[asyncio.Task[None]] = []
        self._first: PromptStream | BeamSearch | None = None  # the prompt whose output came first
        self.interrupted: GatewayError | None = None  # why the gateway ended the stream, if it did

    async def establish(self) -> None:
        """Every prompt's engine answered 200 (GatewayError: one could not; nothing is left open)."""
        try:
            async with asyncio.TaskGroup() as group:
                for prompt in self.prompts:
                    group.create_task(prompt.open())
        except BaseExceptionGroup as failures:
            await self.aclose()
            raise _first_error(failures) from None

    # -- non-streaming ---------------------------------------------------------------

    async def whole(self) -> bytes:
        """One JSON response: every prompt's answer derendered, choices in prompt order."""
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(prompt.whole()) for prompt in self.prompts]
        except BaseExceptionGroup as failures:
            raise _first_error(failures) from None
        tokenized = self._plan.tokenized
        bodies = [await self._ctx.derender.whole(tokenized, task.result(), i) for i, task in enumerate(tasks)]
        return bodies[0] if len(bodies) == 1 else merge_whole(bodies)

    # -- streaming -------------------------------------------------------------------

    async def stream(self) -> AsyncGenerator[bytes, None]:
        """The client's SSE bytes, as the prompts produce them."""
        self._producers = [asyncio.create_task(self._produce(prompt)) for prompt in self.prompts]
        running = len(self._producers)
        while running:
            item = await self._queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, (GatewayError, _Interruption)):
                # Everything closed before the client's last bytes: once they are out, Envoy
                # ends the call, and what is still open would be closed by a cancelled task.
                await self.aclose()
                error = item.error if isinstance(item, _Interruption) else item
                if (record := current()) is not None:
                    record.answer_failed(error.code)
                if isinstance(item, _Interruption):  # its bytes are the client API's (`interrupted`)
                    self.interrupted = error
                    return
                yield sse_event(error.body) + DONE_EVENT
                return
            else:
                yield item
        yield self._usage_chunk() + DONE_EVENT

    async def _produce(self, prompt: PromptStream | BeamSearch) -> None:
        async def put(item: bytes) -> None:
            self._first = self._first or prompt
            await self._put(item)

        try:
            await prompt.run(put)
            await self._put(None)
        except GatewayError as error:
            log.warning(
                "prompt %d of %s failed (%s); cancelling %d sibling streams",
                prompt.index,
                self._plan.tokenized.request_id,
                error.message or error.status,
                len(self.prompts) - 1,
            )
            await self._put(error)
        except Exception:  # a processor bug: the client still gets an end, never a hang
            log.exception("prompt %d of %s: producer failed", prompt.index, self._plan.tokenized.request_id)
            await self._put(GatewayError(500, "internal gateway error", code="internal_error"))

    def interrupt(self, error: GatewayError) -> None:
        """End the client's stream with `error` after what is already queued for it; the
        stream then stops with `interrupted` set, for the writer to say it in the client's API."""
        task = asyncio.ensure_future(self._put(_Interruption(error)))
        self._producers.append(task)  # cancelled with them when the stream closes

    async def _put(self, item: _Item) -> None:
        await self._queue.put(item)
        self.queue_depth_max = max(self.queue_depth_max, self._queue.qsize())

    def _usage_chunk(self) -> bytes:
        """A batch's one usage chunk (a single prompt's session wrote its own)."""
        body = self._plan.tokenized.request.body
        if len(self.prompts) == 1 or not (body.get("stream_options") or {}).get("include_usage"):
            return b""
        prompt = self._plan.tokenized.prompt_tokens
        completion = sum(p.completion_tokens for p in self.prompts)
        chunk: dict[str, Any] = {
            "id": self._plan.tokenized.request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self._plan.tokenized.request.response_model(self._served_name),
            "choices": [],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion},
        }
        chunk = fingerprinted(chunk, self._ctx.planner.catalog.system_fingerprint())
        # native reports the cached tokens of the batch's first result
        first = self._first or self.prompts[0]
        if (cached := first.cached_tokens) is not None:
            chunk["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        return sse_event(orjson.dumps(chunk))

    # -- the end -------------------------------------------------------------------------

    async def _cancel_producers(self) -> None:
        for task in self._producers:
            task.cancel()
        await asyncio.gather(*self._producers, return_exceptions=True)

    async def aclose(self) -> None:
        """Producers cancelled and awaited, every engine stream closed, every lease back."""
        await self._cancel_producers()
        await asyncio.gather(*(prompt.aclose() for prompt in self.prompts), return_exceptions=True)

    def release(self) -> None:
        for prompt in self.prompts:
            prompt.release()


def _first_error(failures: BaseExceptionGroup) -> BaseException:
    """The GatewayError a failed group of prompt tasks means for the client."""
    for failure in failures.exceptions:
        if isinstance(failure, BaseExceptionGroup):
            return _first_error(failure)
        return failure
    return GatewayError(502, "engine streams failed", code="engine_stream_failed")


def merge_whole(bodies: list[bytes]) -> bytes:
    """Per-prompt completions responses as native serving answers a batch: choices in prompt
    order, indexed 0.., usage summed (the cached tokens are the last prompt's, as native's)."""
    merged: dict[str, Any] = orjson.loads(bodies[0])
    choices: list[dict[str, Any]] = []
    totals = dict.fromkeys(("prompt_tokens", "total_tokens", "completion_tokens"), 0)
    for i, body in enumerate(bodies):
        answer = merged if i == 0 else orjson.loads(body)
        for choice in answer["choices"]:
            choice["index"] = len(choices)
            choices.append(choice)
        for key in totals:
            totals[key] += int(answer["usage"][key])
    merged["choices"] = choices
    merged["usage"].update(totals)
    if "prompt_tokens_details" in answer["usage"]:
        merged["usage"]["prompt_tokens_details"] = answer["usage"]["prompt_tokens_details"]
    return orjson.dumps(merged)
