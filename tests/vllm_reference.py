"""What vLLM itself computes, for tests to hold the gateway's own results against."""

from __future__ import annotations

from scheduler.kv_block_hash import Lora


def vllm_hashes(
    block_size: int, token_ids: list[int], cache_salt: str | None = None, lora: Lora | None = None
) -> list[int]:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    kv_cache_utils.init_none_hash(sha256_cbor)
    request = Request(
        "r",
        token_ids,
        SamplingParams(max_tokens=1),
        None,
        cache_salt=cache_salt,
        lora_request=LoRARequest(lora.name, 1, lora.path) if lora else None,
        block_hasher=kv_cache_utils.get_request_block_hasher(block_size, sha256_cbor),
    )
    return [kv_cache_utils.maybe_convert_block_hash(h) for h in request.block_hashes]
