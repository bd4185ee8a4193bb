"""The model catalog (RFC 多模型路由): which `model` names the gateway serves and what each
resolves to, once, before render: the base model (its served name or an alias) or one of its
LoRA adapters (from config, and from what each engine's /v1/models lists with the base as
`parent`). Render and derender always work under the base's served name (vLLM's render has no
LoRA support; adapters share the base's tokenizer); the engine gets the adapter's name.
Also the gateway's own /v1/models: what the engines list, merged, in vLLM's format."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson

from ext_proc.config import ModelConfig
from ext_proc.errors import GatewayError
from ext_proc.protocol import Adapter

Card = dict[str, Any]  # one entry of /v1/models, as vLLM lists it


class ModelCatalog:
    def __init__(self, model: ModelConfig) -> None:
        self._model = model
        self.base_names = (model.served_name, *model.aliases)
        self._configured = {a.name: a.path or "" for a in model.adapters}
        self._engine_cards: dict[str, tuple[Card, ...]] = {}  # per engine address
        self._adapters = dict(self._configured)  # every adapter: name -> path (a request's lookup)
        self._fingerprints: dict[str, str] = {}  # per engine address, those known
        self._fingerprint: str | None = None

    def listed(self, address: str, cards: Sequence[Card], fingerprint: str | None = None) -> None:
        """What an engine's /v1/models listed (its capability record), kept for /v1/models
        and for the adapters it names, and the `system_fingerprint` of its native answers."""
        self._engine_cards[address] = tuple(cards)
        self._adapters = self._found()
        if fingerprint is None:
            self._fingerprints.pop(address, None)
        else:
            self._fingerprints[address] = fingerprint
        self._fingerprint = _agreed(self._fingerprints.values())

    def forget(self, address: str) -> None:
        self._engine_cards.pop(address, None)
        self._adapters = self._found()
        self._fingerprints.pop(address, None)
        self._fingerprint = _agreed(self._fingerprints.values())

    def system_fingerprint(self) -> str | None:
        """What the model's answers carry as `system_fingerprint`: the value its engines' native
        answers carry when they agree (one vLLM version and config); None when none is known or
        they differ (a pool of mixed versions or configs)."""
        return self._fingerprint

    def adapters(self) -> dict[str, str]:
        """Every adapter of the base: name -> path (config first, then as engines list them)."""
        return self._adapters

    def _found(self) -> dict[str, str]:
        found = dict(self._configured)
        for cards in self._engine_cards.values():
            for card in cards:
                if card.get("parent") in self.base_names and isinstance(card.get("id"), str):
                    found.setdefault(card["id"], str(card.get("root") or ""))
        return found

    def serves(self, requested: Any) -> bool:
        """The name is this base's (its served name, an alias or one of its adapters)."""
        return isinstance(requested, str) and (requested in self.base_names or requested in self.adapters())

    def resolve(self, requested: str | None) -> Adapter | None:
        """The adapter the request's model names (None: the base), or native vLLM's 404 for
        a name it does not serve."""
        if requested is None or requested in self.base_names:
            return None
        path = self.adapters().get(requested)
        if path is None:
            raise not_found(requested, self.base_names)
        return Adapter(requested, path or None)

    def cards(self) -> list[Card]:
        """What the engines list (each name once, the first engine's card), then what config
        names that no engine lists yet."""
        cards: dict[str, Card] = {}
        for engine in self._engine_cards.values():
            for card in engine:
                cards.setdefault(str(card.get("id")), card)
        for name in self.base_names:
            cards.setdefault(name, _card(name, self._model.path, None, self._model.max_model_len))
        for name, path in self._configured.items():
            cards.setdefault(name, _card(name, path, self._model.served_name, None))
        return list(cards.values())


def models_body(catalogs: Sequence[ModelCatalog]) -> bytes:
    """/v1/models as the gateway serves it, in vLLM's format: every base model's cards, bases
    before adapters (each adapter's `parent` names its base)."""
    cards: dict[str, Card] = {}
    for catalog in catalogs:
        for card in catalog.cards():
            cards.setdefault(str(card.get("id")), card)
    ordered = sorted(cards.values(), key=lambda card: card.get("parent") is not None)  # stable
    return orjson.dumps({"object": "list", "data": ordered})


def _agreed(values: Iterable[str]) -> str | None:
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else None


def not_found(requested: str, base_names: Sequence[str]) -> GatewayError:
    """vLLM's own answer for a model it does not serve (`serve/engine/serving.py:_check_model`)."""
    message = f"The model `{requested}` does not exist. Valid aliases: {', '.join(base_names)}."
    return GatewayError(404, message, param="model", code=404, kind="NotFoundError")


def _card(name: str, root: str | None, parent: str | None, max_model_len: int | None) -> Card:
    """A card as vLLM's `ModelCard` serializes (for a name no engine has listed yet)."""
    created = int(time.time())
    permission: Mapping[str, Any] = {
        "id": f"modelperm-{secrets.token_hex(8)}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [permission],
    }
