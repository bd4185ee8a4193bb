"""The model catalog: a request's `model` resolved once (base, alias, adapter from config or
from an engine's list), native vLLM's 404 for anything else, and the gateway's /v1/models."""

from __future__ import annotations

import orjson
import pytest

from ext_proc.config import ModelConfig
from ext_proc.errors import GatewayError
from ext_proc.frontend.model_catalog import ModelCatalog, models_body
from ext_proc.protocol import Adapter

MODEL = ModelConfig.model_validate(
    {
        "path": "/models/tiny",
        "served_name": "tiny",
        "aliases": ["tiny-latest"],
        "adapters": [{"name": "sql", "path": "/a/sql"}],
    }
)
ENGINE_CARDS = [
    {"id": "tiny", "object": "model", "root": "/models/tiny", "parent": None, "max_model_len": 2048},
    {"id": "tiny-latest", "object": "model", "root": "/models/tiny", "parent": None, "max_model_len": 2048},
    {"id": "chat-ft", "object": "model", "root": "/mnt/chat-ft", "parent": "tiny", "max_model_len": None},
    {"id": "stranger", "object": "model", "root": "/mnt/x", "parent": "another-base", "max_model_len": None},
]


def test_base_names_and_no_model_resolve_to_the_base() -> None:
    catalog = ModelCatalog(MODEL)
    assert catalog.resolve(None) is None
    assert catalog.resolve("tiny") is None
    assert catalog.resolve("tiny-latest") is None


def test_adapters_come_from_config_and_from_what_engines_list() -> None:
    catalog = ModelCatalog(MODEL)
    assert catalog.resolve("sql") == Adapter("sql", "/a/sql")
    with pytest.raises(GatewayError):
        catalog.resolve("chat-ft")  # no engine lists it yet
    catalog.listed("10.0.0.1:8000", ENGINE_CARDS)
    assert catalog.resolve("chat-ft") == Adapter("chat-ft", "/mnt/chat-ft")
    with pytest.raises(GatewayError):
        catalog.resolve("stranger")  # another base's adapter: not this base's tokenizer
    catalog.forget("10.0.0.1:8000")
    with pytest.raises(GatewayError):
        catalog.resolve("chat-ft")


def test_an_unknown_model_gets_native_vllms_404() -> None:
    with pytest.raises(GatewayError) as raised:
        ModelCatalog(MODEL).resolve("gpt-5")
    assert raised.value.status == 404
    assert orjson.loads(raised.value.body) == {  # serve/engine/serving.py:_check_model
        "error": {
            "message": "The model `gpt-5` does not exist. Valid aliases: tiny, tiny-latest.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_models_lists_every_engines_cards_once_bases_first_then_config_only_names() -> None:
    catalog = ModelCatalog(MODEL)
    catalog.listed("10.0.0.1:8000", ENGINE_CARDS[2:3])  # an engine that lists only an adapter first
    catalog.listed("10.0.0.2:8000", ENGINE_CARDS)
    body = orjson.loads(models_body([catalog]))
    assert body["object"] == "list"
    ids = [(card["id"], card["parent"]) for card in body["data"]]
    assert ids == [
        ("tiny", None),
        ("tiny-latest", None),
        ("chat-ft", "tiny"),
        ("stranger", "another-base"),
        ("sql", "tiny"),  # configured, listed by no engine yet
    ]
    sql = body["data"][-1]
    assert sql["root"] == "/a/sql" and sql["object"] == "model" and sql["owned_by"] == "vllm"
    assert sql["permission"][0]["object"] == "model_permission"
