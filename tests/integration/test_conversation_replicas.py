"""Stored Responses shared by gateway replicas through a real Redis (`conversation_store.backend:
redis`): two gateways (each its Envoy and processor, as two replicas are) over engine
simulators: a turn made through one is continued, retrieved and deleted through the other;
Redis down: reads are a 503, answers still reach their clients, and it all works again once
Redis is back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import RunningStack, metric, running_sim_gateway
from tests.redis_server import RedisServer


def _responses(base_url: str) -> Any:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30).responses


def test_two_replicas_share_the_conversations_in_redis(
    stack: RunningStack, redis_server: RedisServer, tmp_path: Path
) -> None:
    store = {"backend": "redis", "redis_url": redis_server.url, "ttl_s": 600}
    with (
        running_sim_gateway(stack, tmp_path / "a", 1, conversation_store=store) as one,
        running_sim_gateway(stack, tmp_path / "b", 1, conversation_store=store) as two,
    ):
        first = _responses(one.base_url).create(model="tiny", input="hello", max_output_tokens=4)
        second = _responses(two.base_url).create(
            model="tiny", input="again", previous_response_id=first.id, max_output_tokens=4
        )
        assert second.previous_response_id == first.id
        assert _responses(two.base_url).retrieve(first.id) == first
        assert _responses(one.base_url).retrieve(second.id) == second
        # the follow-up's prompt holds the first turn: the first turn's answer text included
        [sent] = two.sims[0].generate_requests()
        [earlier] = one.sims[0].generate_requests()
        assert len(sent.json()["token_ids"]) > len(earlier.json()["token_ids"])
        _responses(two.base_url).delete(first.id)
        with pytest.raises(openai.NotFoundError):
            _responses(one.base_url).retrieve(first.id)

        redis_server.stop()  # down: the answer still comes, not kept; reads are a 503
        lost = _responses(one.base_url).create(model="tiny", input="while down", max_output_tokens=4)
        assert lost.status == "incomplete"
        read = httpx.get(f"{one.base_url}/v1/responses/{second.id}", timeout=10)
        assert read.status_code == 503 and read.json()["error"]["code"] == "store_unavailable"
        failed = metric(one.metrics(), "tito_conversation_store_operations_total", op="put", outcome="error")
        assert failed == 1

        redis_server.start()  # back (an empty Redis: nothing saved to disk)
        kept = _responses(one.base_url).create(model="tiny", input="back", max_output_tokens=4)
        assert _responses(two.base_url).retrieve(kept.id) == kept
