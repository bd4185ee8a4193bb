"""`tito conformance`: every API's cases against the gateway and the engine's own endpoints,
one line per case; exit status 1 on any difference."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial

from ext_proc.tools.conformance import messages, openai, responses
from ext_proc.tools.conformance.core import MAX_REPORTED, CaseResult, new_client


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway", required=True, help="gateway base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--native", required=True, help="the engine's own OpenAI base URL, e.g. http://127.0.0.1:8200")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--only", help="run only the cases whose name contains this")
    parser.add_argument("--max-differences", type=int, default=MAX_REPORTED, help="differences shown per case")
    parser.add_argument(
        "--api",
        choices=("openai", "messages", "responses", "all"),
        default="all",
        help="OpenAI chat/completions, Anthropic Messages, OpenAI Responses",
    )


def run(args: argparse.Namespace) -> int:
    runs: list[Callable[..., CaseResult]] = []
    if args.api in ("openai", "all"):
        runs += [
            partial(openai.run_case, c, args.gateway, args.native, args.model, max_reported=args.max_differences)
            for c in openai.select(args.only)
        ]
    if args.api in ("messages", "all"):
        chosen = [c for c in messages.CASES if not args.only or args.only in c.name]
        runs += [
            partial(messages.run_case, c, args.gateway, args.native, args.model, max_reported=args.max_differences)
            for c in chosen
        ]
    if args.api in ("responses", "all"):
        picked = [c for c in responses.CASES if not args.only or args.only in c.name]
        runs += [
            partial(responses.run_case, c, args.gateway, args.native, args.model, max_reported=args.max_differences)
            for c in picked
        ]
    if not runs:
        print(f"no case matches {args.only!r}", file=sys.stderr)
        return 2
    failed = 0
    with new_client() as client:
        for run in runs:
            result = run(client=client)
            failed += result.status != "PASS"
            print(result.report(), flush=True)
    print(f"{len(runs) - failed}/{len(runs)} cases pass", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tito conformance", description="the gateway's OpenAI answers vs the engine's native ones"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
