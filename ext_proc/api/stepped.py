"""vLLM's own stream converters, stepped by hand.

Native vLLM turns one API's stream into another's with async generators over an input
iterator (`message_stream_converter` for Messages, `responses_stream_generator` for
Responses). They await nothing but that input, so the gateway runs them on the caller's
stack: `Stepped.run` queues the items given and runs the generator exactly as far as they
let it, and the input iterator suspends it when none is queued. No task, no loop hop, and
the converter's bytes are native's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Iterable
from typing import Any, Generic, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")


class Stepped(Generic[In, Out]):
    def __init__(self, make: Callable[[AsyncIterator[In]], AsyncIterator[Out]]) -> None:
        self._feed: _Feed[In] = _Feed()
        self._events = make(self._feed)
        self._pending: Any = None  # the generator's step waiting for input
        self.done = False

    def run(self, items: Iterable[In], end: bool = False) -> list[Out]:
        """Everything the generator yields once `items` are queued (and, with `end`, once its
        input has ended: it then runs to its end)."""
        self._feed.items.extend(items)
        self._feed.closed = self._feed.closed or end
        out: list[Out] = []
        while not self.done:
            if self._pending is None:
                self._pending = self._events.__anext__()
            try:
                signal = self._pending.send(None)
            except StopIteration as step:  # the generator yielded
                self._pending = None
                out.append(step.value)
                continue
            except StopAsyncIteration:
                self._pending, self.done = None, True
                break
            if not isinstance(signal, _Suspend):
                raise RuntimeError(f"a stepped converter awaited {signal!r}")
            break
        return out

    def close(self) -> None:
        """The answer ended early (the client left): the generator runs to its end on an input
        that ends here (what it would still say is dropped), so it is never left suspended:
        asyncio would try to close a suspended one itself, and fail loudly."""
        if not self.done:
            self.run([], end=True)


class _Suspend:
    def __await__(self) -> Generator[_Suspend, None, None]:
        yield self


class _Feed(AsyncIterator[In]):
    def __init__(self) -> None:
        self.items: deque[In] = deque()
        self.closed = False

    async def __anext__(self) -> In:
        while not self.items:
            if self.closed:
                raise StopAsyncIteration
            await _Suspend()
        return self.items.popleft()


def run_coroutine(coroutine: Any) -> Any:
    """An `async def` of vLLM's that awaits nothing that suspends, run to its result here."""
    try:
        signal = coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError(f"a stepped coroutine awaited {signal!r}")
