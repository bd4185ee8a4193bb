"""The permuted copy of a model (ext_proc/tools/obfuscated_model.py): fed physical ids, it
computes exactly what the plain model computes on semantic ids; its tokenizer gives the
physical ids of any text and decodes them back; the special ids its configs name moved."""

from __future__ import annotations

from pathlib import Path

import pytest

from ext_proc.config import TitoConfig
from ext_proc.obfuscation import build_codec
from tests.conftest import missing


def test_the_permuted_tiny_model_computes_on_physical_ids_what_the_plain_one_does(tmp_path: Path) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ext_proc.tools.obfuscated_model import permuted_copy
        from ext_proc.tools.tiny_model import ensure_tiny_model
    except ImportError:
        missing("torch and transformers (pip install 'tito[processor]')")
    plain = ensure_tiny_model(Path("~/.cache/tito").expanduser())
    (tmp_path / "secret").write_text("correct horse battery staple q7zx")
    obfuscation = {"enable": True, "secret_file": str(tmp_path / "secret")}
    config = TitoConfig.model_validate({"model": {"path": str(plain)}, "obfuscation": obfuscation})
    permuted = permuted_copy(config, plain, tmp_path / "permuted")
    codec = build_codec(config)
    assert codec is not None

    text = "<|im_start|>user\nHello 世界 🚀 <think>x</think><tool_call>{}</tool_call><|im_end|>"
    semantic = AutoTokenizer.from_pretrained(plain).encode(text)
    physical = AutoTokenizer.from_pretrained(permuted).encode(text)
    assert physical == codec.physical_ids(semantic) and physical != semantic
    assert AutoTokenizer.from_pretrained(permuted).decode(physical) == text

    models = [AutoModelForCausalLM.from_pretrained(path) for path in (plain, permuted)]
    with torch.no_grad():
        plain_logits = models[0](torch.tensor([semantic])).logits[0]
        permuted_logits = models[1](torch.tensor([physical])).logits[0]
    order = torch.tensor(codec.physical_ids(range(plain_logits.shape[-1])))
    assert torch.equal(permuted_logits[:, order], plain_logits)  # logit π(s) is logit s
    assert models[1].config.eos_token_id == codec.physical_ids([models[0].config.eos_token_id])[0]
    with pytest.raises(AssertionError):  # the control: the plain ids on the permuted model
        assert torch.equal(models[1](torch.tensor([semantic])).logits[0][:, order], plain_logits)
