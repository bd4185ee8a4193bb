"""Engine instances and the pools they belong to."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(enum.Enum):
    UNION = "union"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Instance:
    """One engine, named by the `ip:port` Envoy knows it by in the pool's cluster."""

    address: str
    pool: str
    role: Role


@dataclass(frozen=True)
class Pool:
    name: str
    role: Role
    instances: tuple[Instance, ...]

    @classmethod
    def of(cls, name: str, role: Role, addresses: list[str]) -> Pool:
        return cls(name, role, tuple(Instance(a, name, role) for a in addresses))
