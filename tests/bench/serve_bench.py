"""vLLM's own `bench serve` against the gateway and the same engine's native endpoint.

Starts `tito up`'s stack on free ports (qwen3 + hermes parsers by default), then for each
--concurrency runs vLLM's serving benchmark (`vllm.benchmarks.serve`, random dataset, 64 in /
128 out by default, `ignore_eos`) against the engine's own OpenAI endpoint and against Envoy,
interleaved ABBA over --rounds so drift of the machine weighs on both alike. Printed per
concurrency: the median output throughput of each side and their ratio against its target
(`TARGET_THROUGHPUT`), and the median TTFT of each side.

Run: `python -m tests.bench.serve_bench [--concurrency 8 32] [--num-prompts 32] [--rounds 2]
[--input-len 64] [--output-len 128] [--api completions|chat] [--no-parsers] [--render in_process]`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import signal
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ext_proc.tools.local_stack import LocalStack
from ext_proc.tools.tiny_model import ensure_tiny_model
from tests.bench.gateway_bench import machine_summary, stack_config

# The gateway's output throughput over native's, by concurrency (the per-request CPU issue's
# targets; other concurrencies: the strictest).
TARGET_THROUGHPUT = {8: 0.90, 32: 0.85}
SIDES = ("native", "gateway")


@dataclass
class Runs:
    """One concurrency's runs, per side: output tokens/s and median TTFT (ms)."""

    concurrency: int
    throughput: dict[str, list[float]] = field(default_factory=lambda: {side: [] for side in SIDES})
    ttft_ms: dict[str, list[float]] = field(default_factory=lambda: {side: [] for side in SIDES})

    def report(self) -> str:
        tput = {side: statistics.median(values) for side, values in self.throughput.items()}
        ttft = {side: statistics.median(values) for side, values in self.ttft_ms.items()}
        ratio = tput["gateway"] / tput["native"]
        target = TARGET_THROUGHPUT.get(self.concurrency, max(TARGET_THROUGHPUT.values()))
        verdict = "meets" if ratio >= target else "misses"
        return (
            f"concurrency {self.concurrency:>3}: output {tput['gateway']:.0f} vs {tput['native']:.0f} tok/s "
            f"(x{ratio:.2f}, {verdict} the target x{target:.2f}), median TTFT {ttft['gateway']:.0f} vs "
            f"{ttft['native']:.0f} ms; runs gateway {_rounded(self.throughput['gateway'])}, "
            f"native {_rounded(self.throughput['native'])}"
        )


def _rounded(values: list[float]) -> list[int]:
    return [round(v) for v in values]


def bench_serve(base_url: str, model: str, tokenizer: str, options: argparse.Namespace, concurrency: int) -> Any:
    """One run of vLLM's serving benchmark; its result dict (its own report is not printed)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    chat = options.api == "chat"
    argv = [
        "--backend",
        "openai-chat" if chat else "openai",
        "--endpoint",
        "/v1/chat/completions" if chat else "/v1/completions",
        "--base-url",
        base_url,
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(options.input_len),
        "--random-output-len",
        str(options.output_len),
        "--num-prompts",
        str(options.num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--seed",
        "0",
        "--disable-tqdm",
    ]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    with contextlib.redirect_stdout(io.StringIO()):
        return main(parser.parse_args(argv))


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds per concurrency")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--api", choices=["completions", "chat"], default="completions")
    parser.add_argument("--parsers", action=argparse.BooleanOptionalAction, default=True, help="qwen3 + hermes")
    parser.add_argument("--derender", choices=["in_process", "sidecar"], default="in_process")
    parser.add_argument("--render", choices=["sidecar", "in_process"], default="sidecar")
    parser.add_argument("--cache-dir", default="~/.cache/tito", help="where the tiny model is (generated if missing)")
    parser.add_argument("--work-dir", help="config and logs of the stack (default: a new temporary directory)")
    args = parser.parse_args(argv)
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="tito-serve-bench-"))
    model_path = ensure_tiny_model(Path(args.cache_dir).expanduser())
    config = stack_config(work_dir, model_path, args.parsers, args.derender, render=args.render)
    stack = LocalStack(config, work_dir)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    print(f"starting the stack (logs in {work_dir / 'logs'}) ...", file=sys.stderr, flush=True)
    urls = {"native": config.pools[0].instances[0].url, "gateway": stack.base_url}
    results: list[Runs] = []
    try:
        stack.start()
        model = config.model.served_name
        for concurrency in args.concurrency:
            runs = Runs(concurrency)
            bench_serve(urls["native"], model, str(model_path), args, concurrency)  # warm-up, unmeasured
            for r in range(args.rounds):
                for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                    result = bench_serve(urls[side], model, str(model_path), args, concurrency)
                    if result.get("failed"):
                        print(f"{side}: {result['failed']} failed requests", file=sys.stderr)
                    runs.throughput[side].append(float(result["output_throughput"]))
                    runs.ttft_ms[side].append(float(result["median_ttft_ms"]))
            results.append(runs)
            print(runs.report(), flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        stack.stop()
    parsers = "qwen3 + hermes parsers" if args.parsers else "no parsers"
    print(
        f"vLLM bench serve, random {args.input_len} in / {args.output_len} out, {args.num_prompts} prompts, "
        f"{args.api}, {parsers}, render {args.render}, derender {args.derender}, {args.rounds} rounds (ABBA), medians:"
    )
    for runs in results:
        print("  " + runs.report())
    print(machine_summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
