"""Token obfuscation (RFC Token 混淆适配; reference-systems.md §1.9): engines serve weights
whose vocabulary was permuted with a secret, so no plaintext id may reach them.

Semantic ids (render, derender, budget, the client's `prompt_token_ids`) and physical ids
(engine requests, the scheduler's prefix index) meet at one codec: `TokenCodec.physical`
where a prompt's engine request is made (after render, and for a relay's prompt), and
`TokenCodec.semantic_event` / `semantic_response` where engine ids enter derender, every
stream chunk included. With obfuscation off there is no codec at all: nothing is copied.

The built-in provider is a keyed permutation of `[0, vocab_size)` with fixed points (the
white list); a vendor SDK replaces it through `obfuscation.provider: "module:factory"`,
called as `factory(vocab_size=…, fixed_ids=…, secret=…)`. The secret is read once, from a
file or an environment variable, and is never logged, dumped or put in an error.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from ext_proc.config import ObfuscationConfig, TitoConfig
from ext_proc.errors import GatewayError
from ext_proc.protocol import PromptTokens, TokenizedRequest

# What of a GenerateRequest's sampling params names token ids (lists of ids, or maps keyed by id).
_ID_LISTS = ("stop_token_ids", "allowed_token_ids", "logprob_token_ids")
_ID_KEYED = ("logit_bias",)


class ObfuscationProvider(Protocol):
    """One vocabulary permutation: both directions over 1-D id sequences."""

    def obfuscate(self, ids: Sequence[int]) -> list[int]: ...

    def deobfuscate(self, ids: Sequence[int]) -> list[int]: ...


class KeyedPermutation:
    """A permutation of `[0, vocab_size)` drawn from a secret (SHA-256 of it seeds the
    shuffle), with `fixed_ids` as fixed points. Ids map through two lookup lists: one index
    per id, no call per id, so a chunk's few ids cost well under a microsecond."""

    def __init__(self, vocab_size: int, fixed_ids: Iterable[int], secret: bytes) -> None:
        import random

        if vocab_size <= 0:
            raise ValueError("obfuscation needs a positive vocab_size")
        fixed = {i for i in fixed_ids if 0 <= i < vocab_size}
        movable = [i for i in range(vocab_size) if i not in fixed]
        shuffled = movable.copy()
        seed = int.from_bytes(hashlib.sha256(b"tito-token-permutation/1\0" + secret).digest(), "big")
        random.Random(seed).shuffle(shuffled)
        forward = list(range(vocab_size))
        for semantic, physical in zip(movable, shuffled, strict=True):
            forward[semantic] = physical
        inverse = [0] * vocab_size
        for semantic, physical in enumerate(forward):
            inverse[physical] = semantic
        self.vocab_size = vocab_size
        self._forward = forward
        self._inverse = inverse

    def obfuscate(self, ids: Sequence[int]) -> list[int]:
        return _through(self._forward, ids)

    def deobfuscate(self, ids: Sequence[int]) -> list[int]:
        return _through(self._inverse, ids)


def _through(table: list[int], ids: Sequence[int]) -> list[int]:
    try:
        if len(ids) == 1:  # a stream event's usual load: no comprehension frame
            if ids[0] < 0:
                raise IndexError
            return [table[ids[0]]]
        mapped = [table[i] for i in ids]
    except (IndexError, TypeError) as exc:
        raise ValueError("a token id outside the vocabulary") from exc
    if mapped and min(ids) < 0:  # a negative index would wrap around silently
        raise ValueError("a token id outside the vocabulary")
    return mapped


class TokenCodec:
    """The token boundary: semantic ids inside the gateway, physical ids at the engines."""

    def __init__(self, provider: ObfuscationProvider) -> None:
        self._obfuscate = provider.obfuscate
        self._deobfuscate = provider.deobfuscate

    # -- towards the engines ----------------------------------------------------------------

    def physical(self, tokenized: TokenizedRequest) -> TokenizedRequest:
        """Every prompt with its engine request in physical ids."""
        tokenized.prompts = [self.prompt(p) for p in tokenized.prompts]
        return tokenized

    def prompt(self, prompt: PromptTokens) -> PromptTokens:
        rendered = prompt.generate_request
        if rendered is None:  # never sent to an engine: obfuscation refuses local tokenization
            raise GatewayError(503, "token obfuscation needs render", code="obfuscation_unavailable")
        ids = self.physical_ids(prompt.token_ids)
        params = dict(rendered.get("sampling_params") or {})
        for key in _ID_LISTS:
            if params.get(key):
                params[key] = self.physical_ids(params[key])
        for key in _ID_KEYED:
            if params.get(key):
                physical = self.physical_ids([int(k) for k in params[key]])
                params[key] = {str(k): v for k, v in zip(physical, params[key].values(), strict=True)}  # JSON keys
        return replace(prompt, engine_request={**rendered, "token_ids": ids, "sampling_params": params})

    def physical_ids(self, ids: Sequence[int]) -> list[int]:
        try:
            return self._obfuscate(ids)
        except Exception as exc:  # a provider's own message might carry what it was keyed with
            raise GatewayError(400, "a token id outside the model's vocabulary", code="invalid_token_id") from exc

    # -- from the engines ---------------------------------------------------------------------

    def semantic_event(self, event: dict[str, Any]) -> None:
        """A generate event or response, its ids made semantic in place (choices' token ids,
        logprobs and the stop token that ended them, the echoed prompt ids)."""
        for choice in event.get("choices") or ():
            ids = choice.get("token_ids")
            if ids:
                choice["token_ids"] = self.semantic_ids(ids)
            stop = choice.get("stop_reason")
            if isinstance(stop, int) and not isinstance(stop, bool):  # a stop string stays as it is
                choice["stop_reason"] = self.semantic_ids([stop])[0]
            if choice.get("logprobs"):
                self._semantic_logprobs(choice["logprobs"])
        if event.get("prompt_token_ids"):  # whole responses only
            event["prompt_token_ids"] = self.semantic_ids(event["prompt_token_ids"])
        if event.get("prompt_logprobs"):
            event["prompt_logprobs"] = [self._semantic_keys(p) for p in event["prompt_logprobs"]]

    def _semantic_logprobs(self, logprobs: dict[str, Any]) -> None:
        for entry in logprobs.get("content") or ():
            entry["token_id"] = self.semantic_ids([entry["token_id"]])[0]
            tops = entry.get("top_logprobs") or ()
            for top, semantic in zip(tops, self.semantic_ids([t["token_id"] for t in tops]), strict=True):
                top["token_id"] = semantic

    def _semantic_keys(self, position: dict[str, Any] | None) -> dict[str, Any] | None:
        if not position:
            return position
        keys = self.semantic_ids([int(k) for k in position])
        return {str(k): v for k, v in zip(keys, position.values(), strict=True)}

    def semantic_ids(self, ids: Sequence[int]) -> list[int]:
        try:
            return self._deobfuscate(ids)
        except Exception as exc:
            raise GatewayError(
                502, "engine sent a token id outside the vocabulary", code="engine_invalid_event"
            ) from exc


# -- building it from the config ----------------------------------------------------------------


def build_codec(config: TitoConfig) -> TokenCodec | None:
    """The configured codec (None: obfuscation off). Raises ValueError when it cannot be made:
    the processor must not start and serve plaintext."""
    settings = config.obfuscation
    if not settings.enable:
        return None
    model = Path(config.model.path or "")
    vocab_size = settings.vocab_size or vocab_size_of(model)
    fixed = set(settings.fixed_ids) | (added_token_ids(model) if settings.fix_added_tokens else set())
    secret = read_secret(settings)
    factory: Any = KeyedPermutation
    if settings.provider != "permutation":
        module, _, name = settings.provider.partition(":")
        factory = getattr(importlib.import_module(module), name)
    return TokenCodec(factory(vocab_size=vocab_size, fixed_ids=sorted(fixed), secret=secret))


def read_secret(settings: ObfuscationConfig) -> bytes:
    if settings.secret_file:
        try:
            secret = Path(settings.secret_file).expanduser().read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"obfuscation's secret_file cannot be read: {exc.strerror}") from exc
    else:
        secret = os.environ.get(settings.secret_env, "").encode()
    if not secret:
        where = settings.secret_file or f"${settings.secret_env}"
        raise ValueError(f"obfuscation is on but its secret ({where}) is empty")
    return secret


def vocab_size_of(model: Path) -> int:
    """The engines' vocabulary size: `text_config.vocab_size` first, as multimodal models nest it."""
    try:
        hf_config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"obfuscation needs vocab_size: cannot read {model / 'config.json'}") from exc
    size = (hf_config.get("text_config") or {}).get("vocab_size") or hf_config.get("vocab_size")
    if not isinstance(size, int):
        raise ValueError(f"obfuscation needs vocab_size: none in {model / 'config.json'}")
    return size


def added_token_ids(model: Path) -> set[int]:
    """The tokenizer's added tokens (chat control, think and tool tags): ids render writes
    and parsers look for, kept as fixed points like the SDK's white list."""
    try:
        tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return set()
    return {int(i) for i in tokenizer_config.get("added_tokens_decoder") or {}}
