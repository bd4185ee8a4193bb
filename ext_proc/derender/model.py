"""What in-process derender holds per base model: the engines' tokenizer, detokenizers and
reasoning/tool parsers built as vLLM builds them, and the usage details native reports."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from ext_proc.config import ModelConfig
from ext_proc.derender.logprobs import (
    LogprobDecoder,
    prompt_logprobs_field,
)
from ext_proc.derender.parser_shapes import share_parser_engines
from ext_proc.extras import PROCESSOR, require
from ext_proc.protocol import Pipeline, PromptTokens, TokenizedRequest


class DerenderModel:
    """What every request of one processor shares: tokenizer, parser class, decoder.

    Loading imports vLLM (and torch): seconds, so it happens once at start-up."""

    def __init__(self, config: ModelConfig, block_size: int = 128) -> None:
        require("derender (the engines' tokenizer, detokenizer and parsers)", PROCESSOR, "vllm")
        if not config.path:
            raise ValueError("in-process derender needs model.path (the engines' tokenizer)")
        from vllm.parser import ParserManager
        from vllm.tokenizers import get_tokenizer

        self.served_name = config.served_name
        self.chat_template = config.chat_template
        self.enable_auto_tools = config.enable_auto_tool_choice
        self.tokenizer = get_tokenizer(config.path)
        share_parser_engines(self.tokenizer)  # its parsers then derive what the tokenizer alone gives once
        self.parser_cls = ParserManager.get_parser(
            tool_parser_name=config.tool_call_parser,
            reasoning_parser_name=config.reasoning_parser,
            enable_auto_tools=config.enable_auto_tool_choice,
            model_name=config.path,
            tokenizer=self.tokenizer,
        )
        self.logprobs = LogprobDecoder(self.tokenizer)
        self.include_reasoning_details = bool(config.reasoning_parser)
        self.block_size = block_size  # the engines' KV block size (`pools[].block_size`)
        # the engines' `system_fingerprint` as last learned (the model catalog's, once wired)
        self.system_fingerprint: Callable[[], str | None] = _unknown

    def prompt_details(self, chat: bool, prompt_tokens: int, cached: int, whole: bool) -> dict[str, Any]:
        """Native's `prompt_tokens_details` (a stream's without its nulls). Generate reports
        only the cached tokens; chat also counts the tokens the prefill wrote to the prefix
        cache: the prompt's full blocks less the cached ones (`PrefillStats.finalize`)."""
        written = prompt_tokens // self.block_size * self.block_size
        details = {
            "cached_tokens": cached,
            "created_cache_tokens": max(0, written - cached) if chat else None,
            "multimodal_tokens": None,
        }
        return details if whole else {k: v for k, v in details.items() if v is not None}

    def client_request(self, request: TokenizedRequest) -> Any:
        """vLLM's own model of the client request, as native serving validates it (the one
        render validated, when it rendered in this process)."""
        if request.request.validated is not None:
            return request.request.validated
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        cls = ChatCompletionRequest if request.api is Pipeline.CHAT else CompletionRequest
        return cls.model_validate(request.request.body)

    def parser(self, client: Any) -> Any:
        if self.parser_cls is None:
            return None
        kwargs = client.build_chat_params(self.chat_template, "auto").chat_template_kwargs
        return self.parser_cls(self.tokenizer, client.tools, chat_template_kwargs=kwargs, model_config=None)

    def prompt_logprobs(self, generate: dict[str, Any], prompt: PromptTokens) -> list[Any] | None:
        """A whole answer's `prompt_logprobs` field as native shows it, decoded here (under
        obfuscation the engine's own texts would be of physical ids)."""
        plp = generate.get("prompt_logprobs")
        return None if plp is None else prompt_logprobs_field(self.logprobs.prompt_positions(plp, prompt.token_ids))

    def detokenizer(self, prompt: PromptTokens, params: dict[str, Any]) -> Any:
        """The engine's own incremental detokenizer, primed with the prompt like the engine's."""
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        sampling = SimpleNamespace(
            stop=params.get("stop"),
            min_tokens=params.get("min_tokens", 0),
            include_stop_str_in_output=params.get("include_stop_str_in_output", False),
            skip_special_tokens=params.get("skip_special_tokens", True),
            spaces_between_special_tokens=params.get("spaces_between_special_tokens", True),
        )
        engine_request = SimpleNamespace(
            sampling_params=sampling, prompt_token_ids=prompt.token_ids, prompt_embeds=None, request_id=""
        )
        return IncrementalDetokenizer.from_new_request(self.tokenizer, engine_request)  # type: ignore[arg-type]


def _unknown() -> str | None:
    return None


def fingerprinted(chunk: dict[str, Any], fingerprint: str | None) -> dict[str, Any]:
    """A stream's last chunk as native stamps it: `system_fingerprint` before `usage`, when
    the engines' is known (native's chunk leaves a null out)."""
    if fingerprint is None:
        return chunk
    usage = chunk.pop("usage", None)
    chunk["system_fingerprint"] = fingerprint
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def cached_tokens(usage: Any) -> int | None:
    """The engine's prefix-cache hits in a generate usage, or None: an engine started
    without `--enable-prompt-tokens-details` reports none (nor does native serving then)."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return None if cached is None else int(cached)
