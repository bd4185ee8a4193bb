"""`tito engines --config FILE`: what every engine and render endpoint of a config serves
(of every base model; a discovered pool's engines as its discovery finds them now),
probed now the way a processor probes them at start-up (`ext_proc/fleet/capabilities.py`),
one line each: what it serves, what differs from the config, whether it routes and how.

Exit status 0 when every pool has an engine that routes (the processor would be ready), else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from ext_proc.config import TitoConfig, load_config
from ext_proc.fleet.capabilities import Capabilities
from ext_proc.fleet.discovery import discover_once
from ext_proc.fleet.http_client import http_client
from ext_proc.fleet.membership import Membership
from ext_proc.frontend.tokenization import LocalTokenizer, TokenizationService
from ext_proc.server import build_render_pool, build_scheduler


async def probe(config: TitoConfig) -> tuple[Capabilities, Membership]:
    """One probe round over every endpoint of the config (and what its discovered pools find
    now), decided."""
    http, _ = http_client(config)
    async with http:
        tokenization = TokenizationService(await build_render_pool(config), LocalTokenizer(None))
        scheduler = build_scheduler(config, gated=True)
        capabilities = Capabilities(config, scheduler, tokenization, http)
        membership = Membership(config, scheduler, capabilities, lambda pool, instance: [])
        for pool in config.pools:
            if pool.discovery.dynamic:
                membership.publish(pool, await discover_once(pool))
        await capabilities.refresh()
    return capabilities, membership


def engine_line(address: str, role: str, record: dict[str, Any]) -> str:
    if not record.get("complete"):
        return f"engine {address} ({role}): no record ({record.get('error') or 'not reachable'}) -> held out"
    serves = ", ".join(record["served_models"]) or "nothing"
    adapters = f" + LoRA {', '.join(record['lora_adapters'])}" if record["lora_adapters"] else ""
    facts = f"max_model_len {record['max_model_len']}, block {record['block_size']}, hash {record['hash_algo']}"
    line = (
        f"engine {address} ({role}): vLLM {record['version']}, serves {serves}{adapters} [{facts}],"
        f" token-only generate {record['token_only']}, tokenizer {record['tokenizer']}"
    )
    if record["differences"]:
        adopted = " (adopted)" if record["adopted"] else ""
        line += f", differs from config: {'; '.join(record['differences'])}{adopted}"
    if record.get("error"):
        line += f", last probe failed: {record['error']}"
    if not record["routes"]:
        return f"{line} -> held out: {record['held_out']}"
    return f"{line} -> routes {'token-only' if record['path'] == 'token_only' else 'natively'}"


def render_line(name: str, record: dict[str, Any]) -> str:
    if "tokenizer" not in record:
        return f"render {name}: not probed -> used"
    if record.get("error"):
        return f"render {name}: {record['error']} -> used when it answers"
    serves = ", ".join(record["served_models"]) or "?"
    line = f"render {name}: vLLM {record['version']}, serves {serves}, canary {record['canary_ids']} ids, tokenizer {record['tokenizer']}"
    return f"{line} -> {'used' if record['used'] else 'not used (tokenizer mismatch)'}"


def report(capabilities: Capabilities, membership: Membership) -> list[str]:
    snapshot = capabilities.snapshot()
    lines = [render_line(name, record) for name, record in snapshot["render"].items()]
    for address, (pool, _) in membership.members.items():
        found = f"{pool.role}, {pool.discovery.source}" if pool.discovery.dynamic else pool.role
        lines.append(engine_line(address, found, snapshot["engines"][address]))
    lines += [f"pool {pool.name} ({pool.discovery.source}): no instance found" for pool in membership.empty_pools()]
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """None of its own: the engines are the global --config's."""


def run(args: argparse.Namespace) -> int:
    logging.getLogger("tito").setLevel(logging.ERROR)  # the lines below say it all
    ready = True
    for base in load_config(args.config).bases():  # each base model: its render endpoints and engines
        capabilities, membership = asyncio.run(probe(base))
        for line in report(capabilities, membership):
            print(line)
        ready = ready and capabilities.ready()
    return 0 if ready else 1
