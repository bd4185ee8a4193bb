"""`tito hash-key`: how an API key is stored in `tenancy.keys_file` (its SHA-256, never the key).
The key is read from standard input, so it stays out of the shell's history and `ps`."""

from __future__ import annotations

import argparse
import sys

from ext_proc.tenancy.keys import hash_key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "print the stored form of the API key read from standard input"


def run(args: argparse.Namespace) -> int:
    key = sys.stdin.readline().strip()
    if not key:
        print("no key on standard input", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0
