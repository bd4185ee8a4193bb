"""Token obfuscation's codec: the keyed permutation and the token boundary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ext_proc.config import TitoConfig
from ext_proc.errors import GatewayError
from ext_proc.frontend.token_only import generate_body
from ext_proc.obfuscation import KeyedPermutation, TokenCodec, build_codec
from ext_proc.planning.planner import Planner
from ext_proc.protocol import OpenAIRequest, Pipeline, PromptTokens, TokenizedRequest
from ext_proc.server import build_scheduler

VOCAB = 1000
FIXED = [0, 1, 2, 500, 999]


def permutation(secret: bytes = b"s3cret") -> KeyedPermutation:
    return KeyedPermutation(VOCAB, FIXED, secret)


def test_the_permutation_is_a_bijection_with_the_white_list_fixed() -> None:
    p = permutation()
    everything = list(range(VOCAB))
    forward = p.obfuscate(everything)
    assert sorted(forward) == everything
    assert [forward[i] for i in FIXED] == FIXED
    moved = sum(forward[i] != i for i in everything)
    assert moved > VOCAB * 0.9  # a permutation, not the identity
    assert p.deobfuscate(forward) == everything
    assert p.obfuscate(p.deobfuscate(everything)) == everything


def test_the_same_secret_gives_the_same_permutation_and_another_a_different_one() -> None:
    everything = list(range(VOCAB))
    assert permutation().obfuscate(everything) == permutation().obfuscate(everything)
    assert permutation(b"other").obfuscate(everything) != permutation().obfuscate(everything)


@pytest.mark.parametrize("ids", [[VOCAB], [-1], [3, VOCAB + 5]])
def test_ids_outside_the_vocabulary_are_refused(ids: list[int]) -> None:
    with pytest.raises(ValueError):
        permutation().obfuscate(ids)
    codec = TokenCodec(permutation())
    with pytest.raises(GatewayError) as err:
        codec.semantic_event({"choices": [{"index": 0, "token_ids": ids}]})
    assert err.value.status == 502


def test_a_prompt_gets_physical_ids_and_id_valued_sampling_params() -> None:
    p = permutation()
    codec = TokenCodec(p)
    rendered = {
        "token_ids": [5, 6, 7],
        "sampling_params": {"stop_token_ids": [8], "logit_bias": {"9": 1.5}, "allowed_token_ids": [10, 11], "n": 1},
    }
    prompt = codec.prompt(PromptTokens.rendered(rendered))
    assert prompt.token_ids == [5, 6, 7]  # semantic: render, derender, the client
    assert prompt.generate_request is rendered
    assert prompt.engine_ids == p.obfuscate([5, 6, 7])
    assert prompt.engine_request is not None
    params = prompt.engine_request["sampling_params"]
    assert params["stop_token_ids"] == p.obfuscate([8])
    assert params["allowed_token_ids"] == p.obfuscate([10, 11])
    assert params["logit_bias"] == {str(p.obfuscate([9])[0]): 1.5}
    generate_body(prompt, 4, sampled_beside_k=True)  # serializable as it is
    assert params["n"] == 1
    with pytest.raises(GatewayError) as err:
        codec.prompt(PromptTokens([5, 6]))  # locally tokenized: never for an obfuscated engine
    assert err.value.status == 503


def test_engine_events_become_semantic_in_place() -> None:
    p = permutation()
    codec = TokenCodec(p)
    out, tops = p.obfuscate([20, 21]), p.obfuscate([21, 22])
    event = {
        "choices": [
            {
                "index": 0,
                "token_ids": out,
                "logprobs": {
                    "content": [
                        {"token_id": out[0], "logprob": -0.1, "top_logprobs": [{"token_id": t} for t in tops]},
                    ]
                },
            }
        ],
        "prompt_token_ids": p.obfuscate([1, 30]),
        "prompt_logprobs": [None, {str(p.obfuscate([30])[0]): {"logprob": -1.0}}],
    }
    codec.semantic_event(event)
    choice = event["choices"][0]
    assert choice["token_ids"] == [20, 21]
    assert choice["logprobs"]["content"][0]["token_id"] == 20
    assert [t["token_id"] for t in choice["logprobs"]["content"][0]["top_logprobs"]] == [21, 22]
    assert event["prompt_token_ids"] == [1, 30]
    assert event["prompt_logprobs"] == [None, {"30": {"logprob": -1.0}}]


def test_the_codec_comes_from_the_config_with_the_models_vocab_and_added_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 300}, "vocab_size": 7}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"250": {}, "251": {}}}))
    settings = {"enable": True, "fixed_ids": [3]}
    config = TitoConfig.model_validate({"model": {"path": str(tmp_path)}, "obfuscation": settings})
    with pytest.raises(ValueError, match="secret"):
        build_codec(config)
    monkeypatch.setenv("TOKEN_OBFUSCATION_SECRET", "k")
    codec = build_codec(config)
    assert codec is not None
    every = list(range(300))
    event = {"choices": [{"token_ids": KeyedPermutation(300, [3, 250, 251], b"k").obfuscate(every)}]}
    codec.semantic_event(event)
    assert event["choices"][0]["token_ids"] == every
    assert build_codec(TitoConfig()) is None


def test_each_base_model_has_its_own_secret_and_vocabulary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, size in (("a", 300), ("b", 200)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"vocab_size": size}))
    monkeypatch.setenv("SECRET_A", "ka")
    monkeypatch.setenv("SECRET_B", "kb")
    second = {
        "model": {"path": str(tmp_path / "b"), "served_name": "b"},
        "pools": [{"instances": [{"port": 8300}]}],
        "obfuscation": {"enable": True, "secret_env": "SECRET_B"},
    }
    config = TitoConfig.model_validate(
        {
            "model": {"path": str(tmp_path / "a"), "served_name": "a"},
            "obfuscation": {"enable": True, "secret_env": "SECRET_A"},
            "models": [second],
        }
    )
    first_codec, second_codec = (build_codec(base) for base in config.bases())
    assert first_codec is not None and second_codec is not None
    ids = list(range(200))
    assert first_codec.physical_ids(ids) == KeyedPermutation(300, [], b"ka").obfuscate(ids)
    assert second_codec.physical_ids(ids) == KeyedPermutation(200, [], b"kb").obfuscate(ids)
    with pytest.raises(GatewayError):  # the second base's vocabulary is its own
        second_codec.physical_ids([250])


def test_the_prefix_index_is_keyed_on_physical_ids() -> None:
    config = TitoConfig.model_validate({"scheduler": {"policy": "kv_cache_affinity"}, "pools": [{"block_size": 16}]})
    planner = Planner(config, None, build_scheduler(config))  # type: ignore[arg-type]
    semantic = list(range(100, 164))
    rendered = {"token_ids": semantic, "sampling_params": {"max_tokens": 4}, "request_id": "cmpl-1"}
    prompt = TokenCodec(permutation()).prompt(PromptTokens.rendered(rendered))
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4}
    tokenized = TokenizedRequest(OpenAIRequest(Pipeline.COMPLETIONS, body), "cmpl-1", [prompt])
    plan = planner.place(tokenized, b"{}")
    index = planner.scheduler.prefix_index
    assert index.match(index.hashes(prompt.engine_ids)) == {"127.0.0.1:8200": 4}  # blocks of 16
    assert index.match(index.hashes(semantic)) == {}
    planner.finish(plan.legs[0].lease_id)  # type: ignore[union-attr]


def test_obfuscation_without_render_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="render_config.enable"):
        TitoConfig.model_validate({"obfuscation": {"enable": True}, "render_config": {"enable": False}})
