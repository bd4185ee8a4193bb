"""The floor under the processor's per-chunk cost: gRPC CPU per ext_proc message, per server.

A server process answers every `response_body` message of K concurrent bidi streams with one
`response_body` reply, as Envoy and the processor do for each engine event of a routed stream;
a client process (on the other core when there are two) sends N messages per stream, each after
the previous reply. Two server shapes, measured in the same run, alternating:
- `minimal`: `async for message in messages: yield reply` — the least a Python servicer can do;
- `outbox`: the processor's own shape (`ext_proc/envoy_protocol/stream.py`): a reader task puts
  replies in the call's outbox, so the processor can also send between Envoy's messages; on
  grpc.aio the outbox is a queue that a writer task drains (`processor.grpc_server: grpcio`).
And the outbox shape on uvloop (`processor.event_loop`, the default) against asyncio's own loop,
`sync`: grpc's thread-pool server (`grpc.server`), the other server Python's gRPC offers, and
`h2`: the outbox shape on the processor's own HTTP/2 server (`processor.grpc_server: h2`, the
default; the others are grpcio's).
`--pace-ms` spaces each stream's messages as an engine spaces its tokens (8 streams of a CPU
engine: about 6 ms): every message then wakes the server from idle, which costs more than
back-to-back messages (`--pace-ms 0`).
Printed per case: server CPU µs per message (from /proc), messages/s, outbox / minimal, and
uvloop / asyncio. Then what a stream itself costs, as Envoy opens one per request: streams one
after another (`--one-by-one`) of 1 and of 11 messages, 2 ms apart, give the server CPU to
open and end a stream and the cost of each message in it, on the processor's shape (grpc.aio
and h2) and on the thread-pool server; and the floor under any transport: a uvloop TCP server echoing the same
bytes, one message at a time, each waking it from idle (no gRPC, no HTTP/2). Compare with the processor's CPU per
engine event (`processor_bench`, `gateway_bench`): what is above this floor is derender, SSE
and the exchange's own work.

Run: `python -m tests.bench.grpc_bench [--messages 300] [--streams 8] [--pace-ms 6] [--rounds 5]
[--one-by-one 200]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import uvloop

from ext_proc.envoy_protocol import h2_server
from ext_proc.envoy_protocol.h2_server import H2GrpcServer, Method
from ext_proc.envoy_protocol.stream import PROCESS, QueuedOutbox
from protos.stubs import ext_proc_grpc, ext_proc_pb
from tests.bench.cpu_accounting import process_cpu_seconds
from tests.conftest import free_port

EVENT = b'data: {"request_id":"x","choices":[{"index":0,"token_ids":[1234],"finish_reason":null}]}\n\n'
Messages = AsyncIterator[ext_proc_pb.ProcessingRequest]


def _reply(message: ext_proc_pb.ProcessingRequest) -> ext_proc_pb.ProcessingResponse:
    reply = ext_proc_pb.ProcessingResponse()
    reply.response_body.response.body_mutation.streamed_response.body = message.response_body.body
    return reply


class Sync(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def Process(self, messages: Iterator[Any], context: Any) -> Iterator[Any]:  # noqa: N802
        for message in messages:
            yield _reply(message)


class Minimal(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    async def Process(self, messages: Messages, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        async for message in messages:
            yield _reply(message)


async def _outbox(messages: Messages, outbox: h2_server.Outbox) -> None:
    """The processor's shape (`ExternalProcessor._exchange`): a reader task puts each reply in
    the call's outbox (the h2 server writes it at once; grpc.aio's waits for a writer task),
    and the method waits for the reader's end."""
    done = asyncio.get_running_loop().create_future()

    async def read() -> None:
        async for message in messages:
            outbox.put(_reply(message))
        done.set_result(None)

    reader = asyncio.create_task(read())
    await done
    await reader


class Outbox(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    async def Process(self, messages: Messages, context: Any) -> None:  # noqa: N802
        outbox = QueuedOutbox()  # (grpc.aio's write, as `processor.grpc_server: grpcio`)

        async def exchange() -> None:
            await _outbox(messages, outbox)
            outbox.put(None)

        await asyncio.gather(exchange(), outbox.drain(context.write))


SHAPES = {"minimal": Minimal, "outbox": Outbox}
# (shape, event loop) measured, alternating; `h2`: the outbox shape on the processor's own server
CASES = [("minimal", "asyncio"), ("outbox", "asyncio"), ("outbox", "uvloop"), ("h2", "uvloop"), ("sync", "threads")]
STREAM_SPAN = 10  # extra messages of the long streams in `stream_cost`
ONE_BY_ONE_PACE_MS = 2.0  # between a request's messages: each wakes the server from idle


async def _serve(shape: str, port: int) -> None:
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(SHAPES[shape](), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _serve_h2(port: int) -> None:
    server = H2GrpcServer({PROCESS: Method(ext_proc_pb.ProcessingRequest, _outbox, stream=True)}, 64 << 20)
    await server.start("127.0.0.1", port)
    await asyncio.Event().wait()


def _wait_listening(port: int, timeout_s: float = 30.0) -> None:
    """Until the server just forked accepts connections."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _serve_sync(port: int) -> None:
    server = grpc.server(ThreadPoolExecutor(16))
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(Sync(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._transport.write(data)  # type: ignore[attr-defined]


async def _serve_echo(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(_Echo, "127.0.0.1", port)
    await server.serve_forever()


def _echo_load(port: int, messages: int, pace_s: float) -> float:
    """One connection, a framed message at a time, each answer read before the next is sent."""
    request = ext_proc_pb.ProcessingRequest()
    request.response_body.body = EVENT
    framed = b"\0" + len(request.SerializeToString()).to_bytes(4, "big") + request.SerializeToString()
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(messages):
            connection.sendall(framed)
            got = 0
            while got < len(framed):
                got += len(connection.recv(65536))
            time.sleep(pace_s)
    return time.perf_counter() - started


async def _load(port: int, messages: int, streams: int, pace_s: float = 0.0, one_by_one: bool = False) -> float:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ext_proc_grpc.ExternalProcessorStub(channel)

        async def one() -> None:
            call = stub.Process()
            request = ext_proc_pb.ProcessingRequest()
            request.response_body.body = EVENT
            for _ in range(messages):
                await call.write(request)
                await call.read()
                if pace_s:
                    await asyncio.sleep(pace_s)
            await call.done_writing()
            await call.code()  # the server ended the call: its whole cost is in

        started = time.perf_counter()
        if one_by_one:  # as Envoy opens a stream per request: each one's set-up and end counted
            for _ in range(streams):
                await one()
        else:
            await asyncio.gather(*(one() for _ in range(streams)))
        return time.perf_counter() - started


@contextlib.contextmanager
def _forked_server(serve: Callable[[int], None]) -> Iterator[tuple[int, int]]:
    """(pid, port) of a child process running `serve(port)` on the first core, while this one
    runs on the others (when there are two)."""
    cores = sorted(os.sched_getaffinity(0))
    port = free_port()
    pid = os.fork()
    if pid == 0:
        os.sched_setaffinity(0, {cores[0]})
        serve(port)
        os._exit(0)
    try:
        if len(cores) > 1:
            os.sched_setaffinity(0, set(cores[1:]))
        _wait_listening(port)
        yield pid, port
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.sched_setaffinity(0, set(cores))


def _grpc_server(shape: str, loop: str) -> Callable[[int], None]:
    if shape == "sync":
        return _serve_sync
    if shape == "h2":
        return lambda port: (uvloop.run if loop == "uvloop" else asyncio.run)(_serve_h2(port))
    return lambda port: (uvloop.run if loop == "uvloop" else asyncio.run)(_serve(shape, port))


def measure(
    shape: str, messages: int, streams: int, loop: str = "asyncio", pace_ms: float = 0.0, one_by_one: bool = False
) -> tuple[float, float]:
    """(server CPU µs per message, messages/s) for one server of `shape` on `loop`, in a child process."""
    with _forked_server(_grpc_server(shape, loop)) as (pid, port):
        asyncio.run(_load(port, max(1, messages // 4), streams, pace_ms / 1000, one_by_one))  # warm-up
        before = process_cpu_seconds(pid)
        wall = asyncio.run(_load(port, messages, streams, pace_ms / 1000, one_by_one))
        spent = process_cpu_seconds(pid) - before
    total = messages * streams
    return 1e6 * spent / total, total / wall


def tcp_floor(messages: int, pace_ms: float = ONE_BY_ONE_PACE_MS) -> float:
    """Server CPU µs per message of a uvloop TCP echo, each message waking it from idle."""
    with _forked_server(lambda port: uvloop.run(_serve_echo(port))) as (pid, port):
        _echo_load(port, max(1, messages // 4), pace_ms / 1000)  # warm-up
        before = process_cpu_seconds(pid)
        _echo_load(port, messages, pace_ms / 1000)
        spent = process_cpu_seconds(pid) - before
    return 1e6 * spent / messages


def stream_cost(
    streams: int, rounds: int, shape: str = "outbox", loop: str = "uvloop", pace_ms: float = ONE_BY_ONE_PACE_MS
) -> tuple[float, float]:
    """(server CPU ms to open and end one stream, µs per message in it): `streams` streams one
    after another of 1 and of 1 + STREAM_SPAN messages, alternating, on `shape` and `loop`; the
    difference gives the per-message cost, the rest of a 1-message stream is its set-up."""
    per_stream: dict[int, list[float]] = {1: [], 1 + STREAM_SPAN: []}
    for _ in range(rounds):
        for n, costs in per_stream.items():
            us_per_message = measure(shape, n, streams, loop, pace_ms, one_by_one=True)[0]
            costs.append(us_per_message * n)
    short, long = (statistics.median(costs) for costs in per_stream.values())
    per_message = (long - short) / STREAM_SPAN
    return (short - per_message) / 1000, per_message


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=300, help="per stream")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--pace-ms", type=float, default=6.0, help="between one stream's messages (0: back to back)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating runs per case (median)")
    parser.add_argument("--one-by-one", type=int, default=200, help="streams opened one after another (0: skip)")
    args = parser.parse_args(argv)
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for shape, loop in CASES:
            runs[shape, loop].append(measure(shape, args.messages, args.streams, loop, args.pace_ms))
    print(
        f"ext_proc gRPC floor: {args.streams} streams x {args.messages} response_body messages, one reply each,"
        f" {args.pace_ms:g} ms apart per stream"
    )
    medians = {case: statistics.median(us for us, _ in r) for case, r in runs.items()}
    for (shape, loop), r in runs.items():
        rate = statistics.median(rate for _, rate in r)
        print(
            f"  {shape:8s} {loop:8s} server CPU {medians[shape, loop]:6.1f} us/message (median of {len(r)}),"
            f" {rate:,.0f} messages/s"
        )
    for label, case, base in (
        ("outbox / minimal (asyncio)", ("outbox", "asyncio"), ("minimal", "asyncio")),
        ("outbox: uvloop / asyncio", ("outbox", "uvloop"), ("outbox", "asyncio")),
        ("outbox on uvloop: h2 / grpc.aio", ("h2", "uvloop"), ("outbox", "uvloop")),
    ):
        # /proc counts CPU in clock ticks: a tiny run may show none
        ratio = f"x{medians[case] / medians[base]:.2f}" if medians[base] > 0 else "too short a run to measure"
        print(f"  {label}: {ratio}")
    if args.one_by_one:
        print(
            f"one stream per request ({args.one_by_one} streams one after another, messages {ONE_BY_ONE_PACE_MS:g} ms apart)"
        )
        for shape, loop in (("outbox", "uvloop"), ("h2", "uvloop"), ("sync", "threads")):
            setup_ms, per_message = stream_cost(args.one_by_one, args.rounds, shape, loop)
            print(
                f"  {shape} on {loop}: set-up and end {setup_ms:.2f} ms of server CPU per stream,"
                f" then {per_message:.0f} us per message"
            )
        floor = statistics.median(tcp_floor(args.one_by_one * STREAM_SPAN) for _ in range(args.rounds))
        print(f"  the floor, a TCP echo on uvloop (no gRPC): {floor:.0f} us per message")
    return 0


if __name__ == "__main__":
    sys.exit(main())
