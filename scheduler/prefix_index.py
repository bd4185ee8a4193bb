"""KV prefix index: which instance holds which full blocks of final prompt token ids.

Each full block's hash is chained through the one before it, so one hash names a whole
prefix and a flat LRU map suffices. Two hash functions: XXH3-64 (block i hashed with block
i-1's hash as seed), or the engines' own (`kv_block_hash.py`) when their KV cache events
feed the index. Entries come from routing-time records and from those events (stored,
removed, all cleared); memory is bounded by `max_blocks` (LRU eviction). Only full blocks
count, like vLLM's own prefix cache.

Blocks are per LoRA adapter: an engine's KV computed under one adapter is useless for
another, so the same tokens under two adapters (or an adapter and the base model) hash apart.
"""

from __future__ import annotations

import sys
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence

import xxhash

from scheduler.kv_block_hash import BlockHasher, Lora

ROOT_SEED = 1337


def adapter_seed(adapter: str | None) -> int:
    """The chain's first seed: the base model's is ROOT_SEED, each adapter's its own."""
    return ROOT_SEED if adapter is None else xxhash.xxh3_64_intdigest(adapter.encode(), seed=ROOT_SEED)


def block_hashes(token_ids: Sequence[int], block_size: int, seed: int = ROOT_SEED) -> list[int]:
    """Chained hashes of the full blocks of little-endian u32 token ids."""
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    words = array("I", token_ids[: n_blocks * block_size])
    if sys.byteorder != "little":
        words.byteswap()
    view = memoryview(words).cast("B")
    step = block_size * 4
    hashes = []
    for start in range(0, n_blocks * step, step):
        seed = xxhash.xxh3_64_intdigest(view[start : start + step], seed=seed)
        hashes.append(seed)
    return hashes


class PrefixIndex:
    def __init__(
        self,
        block_size: int = 16,
        max_blocks: int = 1 << 20,
        hasher: BlockHasher | None = None,
    ) -> None:
        if block_size < 1 or max_blocks < 1:
            raise ValueError("block_size and max_blocks must be positive")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._hasher = hasher
        self._blocks: OrderedDict[int, set[str]] = OrderedDict()
        self._held: Counter[str] = Counter()  # blocks per instance, for /debug/state

    def __len__(self) -> int:
        return len(self._blocks)

    def held(self, address: str) -> int:
        """How many blocks the index says this instance holds."""
        return self._held[address]

    def hashes(
        self, token_ids: Sequence[int], adapter: str | None = None, adapter_path: str | None = None
    ) -> list[int]:
        """The prompt's block hashes under the adapter (None: the base model).

        With the engines' hasher (KV events) the adapter's path is part of the engine's hash:
        without it the engine's ids cannot be predicted, so no blocks (no false match)."""
        if self._hasher is None:
            return block_hashes(token_ids, self.block_size, adapter_seed(adapter))
        if adapter is None:
            return self._hasher.hashes(token_ids)
        if adapter_path is None:
            return []
        return self._hasher.hashes(token_ids, lora=Lora(adapter, adapter_path))

    def remove(self, hashes: Sequence[int], address: str) -> None:
        """The instance no longer holds these blocks (evicted)."""
        blocks = self._blocks
        for h in hashes:
            holders = blocks.get(h)
            if holders is not None and address in holders:
                holders.discard(address)
                self._held[address] -= 1
                if not holders:
                    del blocks[h]

    def clear(self, address: str) -> None:
        """The instance holds nothing any more (its prefix cache was reset): one pass over
        the index, for an event that comes with an engine reset."""
        for h in [h for h, holders in self._blocks.items() if address in holders]:
            self.remove((h,), address)

    def record(self, hashes: Sequence[int], address: str) -> None:
        blocks, held = self._blocks, self._held
        for h in hashes:
            holders = blocks.get(h)
            if holders is None:
                blocks[h] = {address}
                held[address] += 1
            else:
                if address not in holders:
                    holders.add(address)
                    held[address] += 1
                blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            _, evicted = blocks.popitem(last=False)
            held.subtract(evicted)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per instance, how many leading blocks it holds (instances with none are absent)."""
        matched: dict[str, int] = {}
        alive: set[str] = set()
        blocks = self._blocks
        for depth, h in enumerate(hashes):
            holders = blocks.get(h)
            if depth == 0:
                alive = set(holders) if holders else set()
            elif holders is not None and alive <= holders:
                continue  # the common case: everyone still matching holds this block too
            else:
                survivors = alive & holders if holders else set()
                for address in alive - survivors:
                    matched[address] = depth
                alive = survivors
            if not alive:
                return matched
        for address in alive:
            matched[address] = len(hashes)
        return matched
