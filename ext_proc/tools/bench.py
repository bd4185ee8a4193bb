"""`tito bench`: the same streaming workload against the gateway and a native engine, interleaved.

One run alternates rounds between the two sides (a round is `concurrency` concurrent streams to
one side; the next round sends the very same requests, same seeds, to the other side; the side
that goes first alternates), so machine noise hits both sides alike. Every request streams
(`stream: true`, `ignore_eos: true`, fixed `max_tokens`, `temperature: 1.0`, a seed per request,
`include_usage`), and is checked: HTTP 200, no error event, exactly one `data: [DONE]` and it
is the last event, `usage.completion_tokens == max_tokens`.

Measured per request, on the client, from just before the request is sent:
- TTFT: until the first *content-bearing* SSE event: a chat chunk with a non-empty
  `delta.content`, `delta.reasoning`/`reasoning_content` or `delta.tool_calls`, or a completions
  chunk with non-empty `text` (role-only, finish-only and usage-only chunks do not count);
- gaps: between consecutive content-bearing events (what a reader of the stream waits for);
- E2E: until the stream ended (after `[DONE]`).
Chunks are `data:` events other than `[DONE]`. Percentiles pool all requests of a side.

`--tools` sends chat requests with `tools` and a `structured_outputs` regex for one hermes
`<tool_call>`, so even a random-weight model reasons, then calls a tool, and the reasoning and
tool parsers do real work. With a reasoning parser, vLLM applies the grammar only once
reasoning ended, so a `logit_bias` on the `</think>` token (its id asked from the native
engine's `/tokenize`) ends the reasoning after some tens of tokens; the regex starts with
`<tool_call>` because vLLM also feeds a `<tool_call>` emitted during reasoning to the grammar.
After the call the model goes on freely (`ignore_eos`) to max_tokens, which hermes does not
stream (a silent tail: chunks/request is far below max_tokens on both sides).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from ext_proc.tools.bench_report import BenchReport, SideStats, format_report, percentile, ratio
from ext_proc.tools.bench_workload import THINK_END, BenchOptions


@dataclass
class RequestResult:
    index: int
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    chunks: int = 0  # data events other than [DONE]
    content_chunks: int = 0
    completion_tokens: int | None = None


# -- one stream ---------------------------------------------------------------------------


class SseEvents:
    """Incremental SSE framing: bytes in, the `data` of each complete event out
    (LF, CR or CRLF line ends; `data:` with or without a space; multi-line data joined)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        # A trailing CR may be half of a CRLF: keep it until the next chunk.
        cut = len(self._buffer) - 1 if self._buffer.endswith(b"\r") else len(self._buffer)
        text, self._buffer = self._buffer[:cut], self._buffer[cut:]
        *blocks, rest = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n\n")
        self._buffer = rest + self._buffer
        events = []
        for block in blocks:
            data = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
            if data:
                events.append(b"\n".join(data))
        return events


def content_bearing(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return False


async def _one_request(client: httpx.AsyncClient, base_url: str, options: BenchOptions, index: int) -> RequestResult:
    result = RequestResult(index)
    done = 0
    after_done = 0
    start = time.perf_counter()
    last_content: float | None = None
    try:
        async with client.stream("POST", base_url + options.path, json=options.body(index)) as response:
            if response.status_code != 200:
                body = (await response.aread())[:300].decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body.strip()}"
                return result
            events = SseEvents()
            async for chunk in response.aiter_raw():
                now = time.perf_counter()
                for data in events.feed(chunk):
                    if data == b"[DONE]":
                        done += 1
                        continue
                    if done:
                        after_done += 1
                    result.chunks += 1
                    event = orjson.loads(data)
                    if "error" in event:
                        result.error = f"error event: {str(event['error'])[:300]}"
                    if event.get("usage"):
                        result.completion_tokens = event["usage"].get("completion_tokens")
                    if content_bearing(event):
                        result.content_chunks += 1
                        if last_content is None:
                            result.ttft_s = now - start
                        else:
                            result.gaps_s.append(now - last_content)
                        last_content = now
    except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e_s = time.perf_counter() - start
    if result.error is None:
        result.error = _stream_error(options, result, done, after_done)
    return result


def _stream_error(options: BenchOptions, result: RequestResult, done: int, after_done: int) -> str | None:
    if done != 1:
        return f"{done} [DONE] events (expected exactly one)"
    if after_done:
        return f"{after_done} events after [DONE]"
    if result.completion_tokens != options.max_tokens:
        return f"usage.completion_tokens {result.completion_tokens} != max_tokens {options.max_tokens}"
    if result.ttft_s is None:
        return "no content-bearing chunk"
    return None


# -- the interleaved run ----------------------------------------------------------------


@dataclass
class _Side:
    name: str
    url: str
    client: httpx.AsyncClient
    results: list[RequestResult] = field(default_factory=list)
    busy_s: float = 0.0


async def _round(side: _Side, options: BenchOptions, indices: range, record: bool) -> None:
    start = time.perf_counter()
    results = await asyncio.gather(*(_one_request(side.client, side.url, options, i) for i in indices))
    if record:
        side.busy_s += time.perf_counter() - start
        side.results.extend(results)


def _stats(side: _Side, options: BenchOptions) -> SideStats:
    ok = [r for r in side.results if r.error is None]
    failed = [r for r in side.results if r.error is not None]
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    gaps = [g * 1e3 for r in ok for g in r.gaps_s]
    e2e = [r.e2e_s * 1e3 for r in ok]
    n = max(len(ok), 1)
    return SideStats(
        side=side.name,
        ok=len(ok),
        errors=len(failed),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        gap_p50_ms=percentile(gaps, 50),
        gap_p99_ms=percentile(gaps, 99),
        gap_mean_ms=sum(gaps) / len(gaps) if gaps else float("nan"),
        e2e_p50_ms=percentile(e2e, 50),
        e2e_p99_ms=percentile(e2e, 99),
        chunks_per_request=sum(r.chunks for r in ok) / n,
        content_chunks_per_request=sum(r.content_chunks for r in ok) / n,
        tokens_per_s=ratio(len(ok) * options.max_tokens, side.busy_s),
        error_samples=[f"#{r.index}: {r.error}" for r in failed[:5]],
    )


async def _single_token_id(client: httpx.AsyncClient, base_url: str, model: str, text: str) -> int | None:
    """The id of `text` if the engine's tokenizer makes it one token (vLLM's /tokenize)."""
    body = {"model": model, "prompt": text, "add_special_tokens": False}
    try:
        response = await client.post(base_url + "/tokenize", json=body)
        tokens = response.json().get("tokens") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return int(tokens[0]) if isinstance(tokens, list) and len(tokens) == 1 else None


async def run_bench(options: BenchOptions) -> BenchReport:
    limits = httpx.Limits(max_connections=options.concurrency * 2, max_keepalive_connections=options.concurrency * 2)
    timeout = httpx.Timeout(options.timeout_s, connect=10.0)
    async with (
        httpx.AsyncClient(trust_env=False, limits=limits, timeout=timeout) as gateway_client,
        httpx.AsyncClient(trust_env=False, limits=limits, timeout=timeout) as native_client,
    ):
        sides = [
            _Side("gateway", options.gateway.rstrip("/"), gateway_client),
            _Side("native", options.native.rstrip("/"), native_client),
        ]
        if options.tools and options.think_end_id is None:
            think_end_id = await _single_token_id(native_client, sides[1].url, options.model, THINK_END)
            options = dataclasses.replace(options, think_end_id=think_end_id)
        warmup_seed = options.seed + 1_000_000  # other seeds than the measured requests
        warmup = dataclasses.replace(options, seed=warmup_seed)
        for n in range(options.warmup_rounds):
            for side in sides:
                await _round(side, warmup, range(n * options.concurrency, (n + 1) * options.concurrency), False)
        start, round_number = 0, 0
        while start < options.requests:
            indices = range(start, min(start + options.concurrency, options.requests))
            order = sides if round_number % 2 == 0 else sides[::-1]  # ABBA: neither side always goes first
            for side in order:
                await _round(side, options, indices, True)
            start, round_number = indices.stop, round_number + 1
    return BenchReport(options, {side.name: _stats(side, options) for side in sides})


# -- the command ------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway", required=True, help="gateway base URL (Envoy listener), e.g. http://127.0.0.1:8080"
    )
    parser.add_argument("--native", required=True, help="native engine base URL, e.g. http://127.0.0.1:8200")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent streams per round")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--api", choices=["chat", "completions"], default="chat")
    parser.add_argument("--requests", type=int, help="measured requests per side (default: 2 * concurrency)")
    parser.add_argument("--tools", action="store_true", help="chat with tools + reasoning (parsers do real work)")
    parser.add_argument(
        "--warmup", type=int, nargs="?", const=1, default=0, metavar="ROUNDS", help="unmeasured rounds per side first"
    )
    parser.add_argument("--seed", type=int, default=1000, help="seed of request 0 (request i uses seed + i)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    return BenchOptions(
        gateway=args.gateway,
        native=args.native,
        model=args.model,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        api=args.api,
        requests=args.requests if args.requests is not None else 2 * args.concurrency,
        tools=args.tools,
        warmup_rounds=args.warmup,
        seed=args.seed,
        timeout_s=args.timeout,
    )


def _argument_error(args: argparse.Namespace) -> str | None:
    """What argparse cannot check one argument at a time."""
    if args.tools and args.api != "chat":
        return "--tools needs --api chat"
    if args.concurrency < 1 or args.max_tokens < 1 or (args.requests is not None and args.requests < 1):
        return "--concurrency, --max-tokens and --requests must be positive"
    return None


def run(args: argparse.Namespace) -> int:
    error = _argument_error(args)
    if error:  # as argparse reports a usage error: the message, exit status 2
        print(f"tito bench: error: {error}", file=sys.stderr)
        return 2
    report = asyncio.run(run_bench(options_from_args(args)))
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(format_report(report))
    return 1 if report.errors else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tito bench", description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
