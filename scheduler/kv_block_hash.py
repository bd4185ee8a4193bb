"""The engines' own prefix-cache block hashes, so the gateway's index speaks the ids vLLM's
KV cache events carry (`BlockStored.block_hashes`).

vLLM with `--prefix-caching-hash-algo sha256_cbor` hashes each full block as
SHA-256(canonical CBOR of (parent hash, the block's token ids, extra keys or None)); the
first block's parent is SHA-256(CBOR of the seed): "vllm-none-hash", or the engines'
PYTHONHASHSEED when they set one. Extra keys: the LoRA (name, path) on every block, the
request's `cache_salt` on the first. Events carry the low 64 bits of each hash, big-endian,
as an integer. Pure: hashlib and cbor2 only (`tests/unit/test_kv_block_hash.py` checks it
against vLLM's own request block hasher).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2

DEFAULT_SEED = "vllm-none-hash"
_LOW_64 = (1 << 64) - 1


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


@dataclass(frozen=True)
class Lora:
    name: str
    path: str


@dataclass(frozen=True)
class BlockHasher:
    block_size: int
    seed: str = DEFAULT_SEED
    _none_hash: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be positive")
        object.__setattr__(self, "_none_hash", sha256_cbor(self.seed))

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None, lora: Lora | None = None) -> list[int]:
        """The event ids of the prompt's full blocks, in order."""
        size = self.block_size
        parent = self._none_hash
        out: list[int] = []
        lora_key: list[tuple[str, ...]] = [("lora", lora.name, lora.path)] if lora is not None else []
        for start in range(0, len(token_ids) // size * size, size):
            salt: list[tuple[str, ...]] = [("cache_salt", cache_salt)] if start == 0 and cache_salt else []
            extra = tuple(lora_key + salt) or None
            parent = sha256_cbor((parent, tuple(token_ids[start : start + size]), extra))
            out.append(int.from_bytes(parent, "big") & _LOW_64)
        return out
