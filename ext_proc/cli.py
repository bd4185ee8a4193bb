"""The `tito` command."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import sys
from pathlib import Path

import uvloop

from ext_proc.config import ProcessorConfig, load_config
from ext_proc.extras import MissingExtra
from ext_proc.tools.tiny_model import TINY_VOCAB


def _processor(args: argparse.Namespace) -> int:
    from ext_proc.observability.stage_log import configure_logging
    from ext_proc.server import serve

    config = load_config(args.config)
    if args.workers is not None:
        processor = ProcessorConfig.model_validate({**config.processor.model_dump(), "workers": args.workers})
        config = config.model_copy(update={"processor": processor})
    if args.worker is None and config.processor.workers > 1:
        from ext_proc.workers import supervise

        processor = config.processor
        ports = [(processor.host, port) for port, _ in processor.worker_ports()]
        return supervise(functools.partial(_worker_command, args, processor.workers), ports)
    if args.worker is not None:
        config = config.model_copy(update={"processor": config.processor.for_worker(args.worker)})
    configure_logging(args.log_level, config.logging.format)
    (uvloop.run if config.processor.event_loop == "uvloop" else asyncio.run)(serve(config))
    return 0


def _worker_command(args: argparse.Namespace, workers: int, index: int) -> list[str]:
    """One worker of `tito processor --workers N`: the same config, its own ports."""
    config = ["--config", args.config] if args.config else []
    processor = ["processor", "--workers", str(workers), "--worker", str(index)]
    return [sys.executable, "-m", "ext_proc.cli", *config, "--log-level", args.log_level, *processor]


def _envoy_config(args: argparse.Namespace) -> int:
    from ext_proc.envoy_protocol.bootstrap import render_bootstrap

    text = render_bootstrap(load_config(args.config))
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _up(args: argparse.Namespace) -> int:
    from ext_proc.tools.local_stack import run_up

    return run_up(load_config(args.config))


def _tiny_model(args: argparse.Namespace) -> int:
    from ext_proc.tools.tiny_model import ensure_tiny_model

    config = load_config(args.config)
    cache_dir = Path(args.cache_dir or config.local.cache_dir).expanduser()
    for vocab_size in args.vocab_size:
        path = ensure_tiny_model(cache_dir, vocab_size)
        if args.obfuscate_with:  # the engines' copy: its vocabulary permuted as the gateway permutes ids
            from ext_proc.tools.obfuscated_model import permuted_copy

            obfuscation = config.obfuscation.model_copy(update={"enable": True, "secret_file": args.obfuscate_with})
            path = permuted_copy(config.model_copy(update={"obfuscation": obfuscation}), path, Path(f"{path}-permuted"))
        print(path)
    return 0


# Operator tools with flags of their own: `tito bench …` and `tito conformance …` hand the
# rest of the command line to them.
TOOLS = {
    "bench": ("ext_proc.tools.bench", "gateway vs the engine's native endpoint: TTFT, inter-chunk gap, E2E, ratios"),
    "conformance": (
        "ext_proc.tools.conformance",
        "gateway vs native OpenAI answers, field by field, one line per case",
    ),
    "engines": ("ext_proc.tools.engines", "what every engine and render endpoint serves, and whether it routes"),
    "config-reference": ("ext_proc.tools.config_reference", "every config key: type, default, override, meaning"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in TOOLS:
        import importlib

        tool: int = importlib.import_module(TOOLS[argv[0]][0]).main(argv[1:])
        return tool
    parser = argparse.ArgumentParser(
        prog="tito",
        description="token-in/token-out gateway for LLM serving",
        epilog="also: " + "; ".join(f"tito {name} --help: {text}" for name, (_, text) in TOOLS.items()),
    )
    parser.add_argument("--config", help="YAML config file (default: $TITO_CONFIG, else built-in defaults)")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="run the local stack: render sidecar, CPU vLLM engine, processor, Envoy").set_defaults(
        func=_up
    )
    processor = sub.add_parser("processor", help="run the ext_proc gRPC server")
    processor.add_argument("--workers", type=int, help="processes on this host (default: processor.workers)")
    processor.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # set by the supervisor
    processor.set_defaults(func=_processor)
    envoy = sub.add_parser("envoy-config", help="write the Envoy bootstrap for the config")
    envoy.add_argument("--out", help="file to write (default: stdout)")
    envoy.set_defaults(func=_envoy_config)
    tiny = sub.add_parser("tiny-model", help="generate the tiny test model (if missing) and print its path")
    tiny.add_argument("--cache-dir", help="default: local.cache_dir of the config")
    tiny.add_argument(
        "--vocab-size", type=int, nargs="+", default=[TINY_VOCAB], help="one model per size (another tokenizer each)"
    )
    tiny.add_argument(
        "--obfuscate-with",
        metavar="SECRET_FILE",
        help="print the path of a copy whose vocabulary is permuted with this secret (obfuscation's own permutation)",
    )
    tiny.set_defaults(func=_tiny_model)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    try:
        return int(args.func(args))
    except MissingExtra as missing:  # a lean install asked for a part it has not got
        print(f"tito: {missing}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
