"""A copy of a model whose vocabulary is permuted by the gateway's own token obfuscation.

Token obfuscation sends engines physical ids `p = π(s)` for semantic ids `s`. An engine computes
on them exactly what the plain model computes on `s` when its embedding row `p` is the plain
row `s`, and its output projection's row `p` too (logit `p` is then logit `s`); tied weights
are one matrix. Its tokenizer must agree, for what the engine itself reads as text (stop
strings, structured outputs' grammars): token `t` with plain id `s` gets id `π(s)`, added
tokens included, and the special ids the configs name move with them. Ids the permutation
keeps (the added tokens, when `obfuscation.fix_added_tokens`) stay in place.

`tito tiny-model --obfuscate-with SECRET_FILE` writes such a copy of the tiny model; `tito up`
serves it to its engines with `local.permute_engine_weights` (render keeps the plain model).
Operators can point `permuted_copy` at a vendor's plain model to check the vendor's permuted
weights against the gateway's provider, tensor by tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ext_proc.config import TitoConfig
from ext_proc.obfuscation import build_codec, vocab_size_of

# Where Hugging Face checkpoints keep the vocabulary-sized matrices (rows = token ids)
EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")
OUTPUT = ("lm_head.weight",)
SPECIAL_ID_KEYS = ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id")


def permuted_copy(config: TitoConfig, source: Path, out: Path) -> Path:
    """`source` (a plain model: `config.model.path`'s) copied to `out` with its vocabulary
    permuted by the codec `config.obfuscation` builds for it."""
    plain = config.model_copy(update={"model": config.model.model_copy(update={"path": str(source)})})
    codec = build_codec(plain.model_copy(update={"obfuscation": plain.obfuscation.model_copy(update={"enable": True})}))
    assert codec is not None
    vocab = config.obfuscation.vocab_size or vocab_size_of(source)
    physical = codec.physical_ids(range(vocab))  # physical[s] = π(s)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns(".complete", "*.safetensors"))
    _permute_weights(source, tmp, physical)
    _permute_tokenizer(tmp, physical)
    for name in ("config.json", "generation_config.json"):
        if (tmp / name).exists():
            data = json.loads((tmp / name).read_text())
            (tmp / name).write_text(json.dumps(_moved_ids(data, physical), indent=2))
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _permute_weights(source: Path, out: Path, physical: list[int]) -> None:
    """Every safetensors file, its vocabulary-sized matrices' rows moved: row π(s) = plain row s."""
    import torch
    from safetensors.torch import load_file, save_file

    inverse = torch.empty(len(physical), dtype=torch.long)
    inverse[torch.tensor(physical)] = torch.arange(len(physical))  # inverse[p] = s
    for file in sorted(source.glob("*.safetensors")):
        tensors = load_file(str(file))
        for name, tensor in tensors.items():
            if name.endswith(EMBEDDINGS + OUTPUT) and tensor.shape[0] == len(physical):
                tensors[name] = tensor[inverse].contiguous()
        save_file(tensors, str(out / file.name), metadata={"format": "pt"})


def _permute_tokenizer(out: Path, physical: list[int]) -> None:
    """tokenizer.json's vocabulary and added tokens, and tokenizer_config.json's added tokens."""
    tokenizer = out / "tokenizer.json"
    if tokenizer.exists():
        data = json.loads(tokenizer.read_text())
        model = data.get("model") or {}
        if isinstance(model.get("vocab"), dict):
            model["vocab"] = {token: physical[i] for token, i in model["vocab"].items()}
        for added in data.get("added_tokens") or []:
            added["id"] = physical[added["id"]]
        tokenizer.write_text(json.dumps(data, ensure_ascii=False))
    tokenizer_config = out / "tokenizer_config.json"
    if tokenizer_config.exists():
        data = json.loads(tokenizer_config.read_text())
        if isinstance(data.get("added_tokens_decoder"), dict):
            data["added_tokens_decoder"] = {str(physical[int(i)]): v for i, v in data["added_tokens_decoder"].items()}
        tokenizer_config.write_text(json.dumps(data, indent=2, ensure_ascii=False))


def _moved_ids(data: Any, physical: list[int]) -> Any:
    """A model or generation config with its special token ids moved (nested configs too)."""
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            if key in SPECIAL_ID_KEYS and isinstance(value, int):
                out[key] = physical[value]
            elif key in SPECIAL_ID_KEYS and isinstance(value, list):
                out[key] = [physical[v] for v in value]
            else:
                out[key] = _moved_ids(value, physical)
        return out
    return data
