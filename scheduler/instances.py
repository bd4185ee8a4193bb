"""Engine instances and the pools they belong to."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(enum.Enum):
    UNION = "union"
    PREFILL = "prefill"
    DECODE = "decode"


class Capability(enum.Enum):
    """What a decode instance can do besides decoding (Motor's instance capabilities)."""

    HANDOFF = "prefill_handoff_decode"  # decode after a prefill the gateway ran first
    TRIGGER = "concurrent_engine_sync"  # decode first; the engine calls back for prefill
    COLOCATION = "decode_colocation"  # may also serve a request alone (prefill included)


@dataclass(frozen=True)
class Instance:
    """One engine, named by the `ip:port` Envoy knows it by in the engines' cluster."""

    address: str
    pool: str
    role: Role
    capabilities: frozenset[Capability] = frozenset()


@dataclass(frozen=True)
class Pool:
    name: str
    role: Role
    instances: tuple[Instance, ...]
    block_size: int = 16  # the engines' KV block size: the prefix index hashes blocks of it

    @classmethod
    def of(
        cls,
        name: str,
        role: Role,
        addresses: list[str],
        block_size: int = 16,
        capabilities: frozenset[Capability] = frozenset(),
    ) -> Pool:
        return cls(name, role, tuple(Instance(a, name, role, capabilities) for a in addresses), block_size)
