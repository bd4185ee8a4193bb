"""In-process streaming derender on its own: µs per chunk, and whether it grows with output.

A 2,000-token chat answer (reasoning, content with CJK and emoji, a tool call) from the
tiny model's tokenizer, fed one token per generate event through the live-state derender
with the qwen3 and hermes parsers, as the processor runs it. Prints the median cost of the
first and last 200 chunks (their ratio must stay near 1: no per-chunk work that grows with
the output) and the chunks/s one process reaches on this stage alone.

With token obfuscation on, the same stream in physical ids, deobfuscated event by event
first: the chunks/s of both, interleaved, and their ratio.

Observability: the same stream through the processor's derender pipeline (asyncio, as a
stream runs it), with the request's record (metrics, a traced request: in-memory exporter)
and without, interleaved: chunks/s of both and their ratio.

    python -m tests.bench.derender_bench [--tokens 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import orjson
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ext_proc.config import ModelConfig
from ext_proc.derender.chat import ChatStream
from ext_proc.derender.model import DerenderModel
from ext_proc.derender.pipeline import InProcessDerender, StreamDerender
from ext_proc.obfuscation import KeyedPermutation, TokenCodec, added_token_ids, vocab_size_of
from ext_proc.observability.request import Observability
from ext_proc.observability.tracing import tracer_with
from ext_proc.protocol import OpenAIRequest, Pipeline, PromptTokens, TokenizedRequest
from ext_proc.tools.tiny_model import ensure_tiny_model

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
SENTENCE = "the little robot walks to 東京 and says こんにちは 🐉🚀 to everyone it meets, "
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京 🗼"}}\n</tool_call>'


def answer_ids(model: DerenderModel, n_tokens: int) -> list[int]:
    """Token ids of `<think>…</think>` + content + a tool call, about `n_tokens` long."""

    def encode(text: str) -> list[int]:
        return [int(t) for t in model.tokenizer.encode(text)]

    tail, call = encode("\n</think>\n\n"), encode(TOOL_CALL)
    sentence = encode(SENTENCE)
    body = sentence * (n_tokens // len(sentence) + 1)
    half = (n_tokens - len(tail) - len(call)) // 2
    reasoning = (encode("<think>\n") + body)[:half]
    content = body[: n_tokens - len(tail) - len(call) - half]
    return reasoning + tail + content + call


def request(model: DerenderModel) -> TokenizedRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "stream": True}
    prompt = PromptTokens.rendered(
        {
            "token_ids": [
                int(t) for t in model.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
            ],
            "sampling_params": {"skip_special_tokens": False},
            "request_id": "chatcmpl-bench",
        }
    )
    return TokenizedRequest(OpenAIRequest(Pipeline.CHAT, body), "chatcmpl-bench", [prompt])


def load_model() -> DerenderModel:
    path = str(ensure_tiny_model(Path("~/.cache/tito").expanduser()))
    config = ModelConfig(path=path, reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=True)
    return DerenderModel(config)


def codec_for(model: DerenderModel) -> TokenCodec:
    """Token obfuscation as the processor runs it for this model (a fixed test secret)."""
    path = Path(model.tokenizer.name_or_path)
    return TokenCodec(KeyedPermutation(vocab_size_of(path), added_token_ids(path), b"bench-secret"))


def run(model: DerenderModel, n_tokens: int, codec: TokenCodec | None = None) -> dict[str, float]:
    """With `codec`, the engine's ids are physical and each event is deobfuscated first, as
    the processor does with token obfuscation on (timed with the derender step)."""
    ids = answer_ids(model, n_tokens)
    sent = ids if codec is None else codec.physical_ids(ids)
    stream = ChatStream(model, request(model))
    costs: list[float] = []
    out = bytearray()
    for i, token in enumerate(sent):
        last = i == len(sent) - 1
        event = {"choices": [{"index": 0, "token_ids": [token], "finish_reason": "stop" if last else None}]}
        start = time.perf_counter()
        if codec is not None:
            codec.semantic_event(event)
        out += stream.steps([event])
        costs.append(time.perf_counter() - start)
    window = min(200, len(costs) // 4)
    first = statistics.median(costs[1 : window + 1]) * 1e6  # the very first step also builds the role chunk
    end = statistics.median(costs[-window - 1 : -1]) * 1e6
    return {
        "tokens": len(ids),
        "first_us": first,
        "last_us": end,
        "growth": end / first,
        "chunks_per_s": len(costs) / sum(costs),
        "reasoning_chunks": out.count(b'"reasoning"'),
        "content_chunks": out.count(b'"content":"'),
        "tool_call_parsed": float(b'"name":"get_weather"' in out),
    }


def run_pipeline(model: DerenderModel, n_tokens: int, observed: bool) -> float:
    """Chunks/s of a generate SSE stream through `StreamDerender` (framing, parsing, the
    session), as the processor runs an Envoy-routed stream, with or without a traced
    request's record."""
    return asyncio.run(_pipeline(model, n_tokens, observed))


async def _pipeline(model: DerenderModel, n_tokens: int, observed: bool) -> float:
    ids = answer_ids(model, n_tokens)
    raw = [
        b"data: "
        + orjson.dumps({"choices": [{"index": 0, "token_ids": [t], "finish_reason": "stop" if last else None}]})
        + b"\n\n"
        for t, last in zip(ids, [False] * (len(ids) - 1) + [True], strict=True)
    ] + [b"data: [DONE]\n\n"]
    record = None
    if observed:
        observability = Observability(tracer=tracer_with(InMemorySpanExporter()))
        record = observability.begin("bench")
        record.headers("chat", {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    stream = StreamDerender(InProcessDerender(model).stream(request(model)))
    await stream.feed(raw[0])  # builds the session
    start = time.perf_counter()
    for piece in raw[1:]:
        await stream.feed(piece)
    await stream.finish()
    if record is not None:  # its metrics and spans are written at the end: timed too
        record.answered(200, end=True)
        record.finish()
    elapsed = time.perf_counter() - start
    return (len(raw) - 1) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5, help="obfuscation off/on runs, interleaved")
    args = parser.parse_args()
    model = load_model()
    codec = codec_for(model)
    plain, obfuscated = [], []
    for _ in range(args.rounds):
        plain.append(run(model, args.tokens))
        obfuscated.append(run(model, args.tokens, codec))
    r = plain[len(plain) // 2]
    print(f"in-process derender, qwen3+hermes, {r['tokens']:.0f}-token stream, one token per event")
    print(f"  per chunk: first {r['first_us']:.1f} µs, last {r['last_us']:.1f} µs, last/first {r['growth']:.2f}")
    print(f"  derender stage alone: {r['chunks_per_s']:.0f} chunks/s on one core")
    print(
        f"  parsed: {r['reasoning_chunks']:.0f} reasoning chunks, {r['content_chunks']:.0f} content chunks, "
        f"tool call {'found' if r['tool_call_parsed'] else 'MISSING'}"
    )
    off = statistics.median(x["chunks_per_s"] for x in plain)
    on = statistics.median(x["chunks_per_s"] for x in obfuscated)
    same = all(x["tool_call_parsed"] for x in obfuscated)
    print(f"  token obfuscation: {on:.0f} chunks/s on vs {off:.0f} off (median of {args.rounds}): x{on / off:.3f}")
    print(f"    (deobfuscation per event included; output with obfuscation {'parsed' if same else 'BROKEN'})")
    bare, observed, ratios = [], [], []
    for round_ in range(args.rounds * 2):  # pairs in alternating order: drift cancels out
        first, second = (False, True) if round_ % 2 == 0 else (True, False)
        runs = {first: run_pipeline(model, args.tokens, first), second: run_pipeline(model, args.tokens, second)}
        bare.append(runs[False])
        observed.append(runs[True])
        ratios.append(runs[True] / runs[False])
    off, on = statistics.median(bare), statistics.median(observed)
    print(
        f"  metrics + tracing: {on:.0f} chunks/s on vs {off:.0f} off (StreamDerender, {len(ratios)} runs each): "
        f"x{statistics.median(ratios):.3f} (median of the pairs' ratios)"
    )


if __name__ == "__main__":
    main()
