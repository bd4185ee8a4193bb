"""A tiny Qwen3-shaped model made on the spot, for the local stack and the tests.

Nothing can be downloaded here, so the tokenizer is trained on a small built-in corpus and
the weights are random (seeded). ByteLevel BPE round-trips any UTF-8 text and splits
multi-byte characters across tokens, which is exactly what streaming detokenization must
survive. The chat template is Qwen-style so vLLM's `qwen3` reasoning and `hermes` tool
parsers apply.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ext_proc.extras import PROCESSOR, require

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
EOS = "<|im_end|>"
FORMAT_VERSION = "2"  # bump when the generated files change, so caches are rebuilt
TINY_VOCAB = 1024  # the tiny model's vocabulary; another size trains another tokenizer

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{%- endif %}"
    "# Tools\n\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object within <tool_call></tool_call> tags.<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for tc in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)

_CORPUS_SEED = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "What is 2 + 2? The answer is 4. What is 7 * 6? It is 42.",
    "def add(a, b):\n    return a + b\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "Streaming responses arrive as server-sent events, one chunk at a time.",
    "Tokens in, tokens out: the engine never sees text.",
    "你好，世界！今天天气很好。我们一起去公园散步吧。",
    "请把这段文字翻译成英文。推理服务需要低延迟和高吞吐。",
    "こんにちは、世界。東京は晴れです。",
    "안녕하세요, 반갑습니다.",
    "Emoji time: 😀 🚀 🎉 👍🏽 🇫🇷 ❤️ 🤖",
    "Mixed: hello 世界 🌍 — naïve café résumé über straße.",
    "<think>Let me think step by step.</think>The result is ready.",
    '<tool_call>\n{"name": "search", "arguments": {"query": "vLLM"}}\n</tool_call>',
    "system user assistant tool function arguments content reasoning",
    "Once upon a time there was a small model that could only say random things.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828",
]


def _corpus() -> list[str]:
    lines = []
    for i in range(40):
        for j, line in enumerate(_CORPUS_SEED):
            lines.append(f"{line} {i * j}" if (i + j) % 3 == 0 else line)
    return lines


def _train_tokenizer(out: Path, vocab_size: int = TINY_VOCAB) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # another size learns from the corpus written backwards: other merges, so the same text
    # gets other ids (a base model whose tokenizer really differs)
    corpus = _corpus() if vocab_size == TINY_VOCAB else [line[::-1] for line in _corpus()]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS, "pad_token": "<|endoftext|>"}))
    return tokenizer.get_vocab_size()


def _write_model(out: Path, vocab_size: int, eos_id: int, pad_id: int, seed: int = 0) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # vLLM's CPU attention rejects head_dim 16
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(out, safe_serialization=True)
    generation = {"eos_token_id": [eos_id], "pad_token_id": pad_id, "do_sample": True}
    (out / "generation_config.json").write_text(json.dumps(generation))


def ensure_tiny_model(cache_dir: Path, vocab_size: int = TINY_VOCAB) -> Path:
    """The tiny model directory under `cache_dir`, generated once (a few seconds). Another
    `vocab_size` gives another model: its own tokenizer (fewer merges: other ids for the same
    text) and its own weights (a second base model of the catalog)."""
    variant = "" if vocab_size == TINY_VOCAB else f"-vocab{vocab_size}"
    out = cache_dir / f"tiny-qwen3-v{FORMAT_VERSION}{variant}"
    if (out / ".complete").exists():
        return out
    require("generating the tiny model", PROCESSOR, "torch", "transformers", "tokenizers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    vocab = _train_tokenizer(tmp, vocab_size)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp / "tokenizer.json"))
    eos_id, pad_id = tok.token_to_id(EOS), tok.token_to_id("<|endoftext|>")
    assert eos_id is not None and pad_id is not None, "special tokens missing from the trained tokenizer"
    _write_model(tmp, vocab, eos_id, pad_id, seed=TINY_VOCAB - vocab_size)
    return _published(tmp, out)


def ensure_tiny_adapter(cache_dir: Path, base: Path, name: str, rank: int = 8) -> Path:
    """A LoRA adapter of the tiny model (PEFT's files: `adapter_config.json` and
    `adapter_model.safetensors`, q_proj and v_proj of every layer), random but seeded by its
    name, and large enough that its answers differ from the base's. Generated once."""
    out = cache_dir / f"tiny-lora-{name}-v{FORMAT_VERSION}"
    if (out / ".complete").exists():
        return out
    require("generating a tiny LoRA adapter", PROCESSOR, "torch", "safetensors")
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    shapes = {"q_proj": config["num_attention_heads"] * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(sum(name.encode()))
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, width in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(width, rank, generator=generator) * 0.5
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(shapes),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (tmp / "adapter_config.json").write_text(json.dumps(adapter, indent=2))
    return _published(tmp, out)


def _published(tmp: Path, out: Path) -> Path:
    """A finished `tmp` becomes `out`, unless another process won the race (its copy stays)."""
    (tmp / ".complete").write_text("ok\n")
    if out.exists():
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(out)
    return out
