"""The gateway's block hashes are the engines': computed by vLLM's own request block hasher
(`sha256_cbor`, the int form its KV events carry) for the same token ids."""

from __future__ import annotations

import pytest

from scheduler.kv_block_hash import BlockHasher, Lora
from tests.vllm_reference import vllm_hashes

PROMPT = [(i * 7919) % 1021 for i in range(1000)]


@pytest.fixture(autouse=True)
def _no_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # the engines' default: the fixed seed


@pytest.mark.parametrize("block_size", [1, 16, 128, 333])
def test_block_hashes_equal_vllms(block_size: int) -> None:
    ours = BlockHasher(block_size).hashes(PROMPT)
    assert len(ours) == len(PROMPT) // block_size
    assert ours == vllm_hashes(block_size, PROMPT)


@pytest.mark.parametrize("block_size", [16, 128])
def test_cache_salt_and_lora_change_every_hash_as_vllms_do(block_size: int) -> None:
    hasher = BlockHasher(block_size)
    salted = hasher.hashes(PROMPT, cache_salt="tenant-a")
    assert salted == vllm_hashes(block_size, PROMPT, cache_salt="tenant-a")
    assert not set(salted) & set(hasher.hashes(PROMPT))  # the salt in block 0 reaches every chained hash
    lora = Lora("adapter", "/loras/adapter")
    assert hasher.hashes(PROMPT, lora=lora) == vllm_hashes(block_size, PROMPT, lora=lora)


def test_a_shared_prefix_shares_its_hashes_and_a_seed_changes_them() -> None:
    hasher = BlockHasher(16)
    other = PROMPT[:64] + [1] * 64
    assert hasher.hashes(other)[:4] == hasher.hashes(PROMPT)[:4]
    assert hasher.hashes(other)[4:] != hasher.hashes(PROMPT)[4:8]
    assert BlockHasher(16, seed="42").hashes(PROMPT)[0] != hasher.hashes(PROMPT)[0]
