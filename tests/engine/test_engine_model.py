"""Model loading, KV layout, fingerprints, the byte tokenizer and unsupported models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import micro_config, micro_model
from transformers import (
    AutoTokenizer,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    Llama4TextConfig,
    MambaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from engine.model.fingerprint import fingerprint
from engine.model.loading import (
    KVShape,
    LoadedModel,
    ModelLoadError,
    UnsupportedModelError,
    check_supported,
    has_window,
    load_model,
    wrap_model,
)
from engine.model.tiny import byte_tokenizer, random_model


def test_tiny_model_is_pinned_and_produces_varied_greedy_text() -> None:
    tiny = load_model("tiny")
    assert sum(p.numel() for p in tiny.model.parameters()) == 22_819_328
    assert tiny.layout == KVShape(num_layers=8, num_kv_heads=2, head_dim=64)
    assert (tiny.vocab_size, tiny.max_positions, tiny.eos_token_ids) == (260, 4096, (257,))
    q_std = tiny.model.model.layers[0].self_attn.q_proj.weight.std().item()
    assert abs(q_std - 0.1) < 0.002  # initializer_range=0.1 was really used
    ids = tiny.tokenizer("Hello, world! The quick brown fox")["input_ids"]
    with torch.inference_mode():
        out = tiny.model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
    assert len(set(out[0, len(ids) :].tolist())) >= 32
    assert load_model("tiny", model_revision=None).fingerprint == tiny.fingerprint


def test_changing_one_weight_element_changes_the_fingerprint(micro: LoadedModel) -> None:
    model = random_model(micro_config(), seed=1)
    before = fingerprint(model)
    assert before == micro.fingerprint
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3
    assert fingerprint(model) != before


def test_model_revision_pins_the_fingerprint_without_hashing_weights() -> None:
    a, b = random_model(micro_config(), seed=1), random_model(micro_config(), seed=2)
    assert fingerprint(a, "rev-1") == fingerprint(b, "rev-1")
    assert fingerprint(a, "rev-1") != fingerprint(a, "rev-2")
    assert fingerprint(a, "rev-1") != fingerprint(a)


def test_dtype_is_part_of_the_fingerprint() -> None:
    model = random_model(micro_config(), seed=1)
    fp32 = fingerprint(model, "r")
    assert fingerprint(model.to(torch.bfloat16), "r") != fp32


def test_byte_tokenizer_round_trips_and_saves(tmp_path: Path) -> None:
    tok = byte_tokenizer()
    text = "héllo, wörld"
    ids = tok(text)["input_ids"]
    assert ids == [256, *text.encode()]
    assert tok.decode(ids, skip_special_tokens=True) == text
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded(text)["input_ids"] == ids
    chat = loaded.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|bos|>user: hi<|end_of_turn|>\nassistant: "


def test_head_dim_is_read_from_the_model_not_hidden_over_heads() -> None:
    cfg = Qwen3Config(
        vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    )  # fmt: skip
    loaded = wrap_model(random_model(cfg, seed=0), byte_tokenizer(), "qwen3-micro")
    assert loaded.layout == KVShape(num_layers=3, num_kv_heads=2, head_dim=32)


def test_gpt2_style_model_is_supported() -> None:
    cfg = GPT2Config(vocab_size=260, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    loaded = wrap_model(random_model(cfg, seed=0), byte_tokenizer(), "gpt2-micro")
    assert loaded.layout == KVShape(num_layers=2, num_kv_heads=4, head_dim=16)
    assert loaded.max_positions == 128


@pytest.mark.parametrize(
    ("config", "layer_type"),
    [
        (Llama4TextConfig(attention_chunk_size=64), "chunked_attention"),
        (DeepseekV3Config(), "multi_latent_attention"),
        (MambaConfig(), "linear_attention"),
    ],
    ids=["llama4-chunked", "deepseek-v3-mla", "mamba"],
)  # fmt: skip
def test_unsupported_layer_types_raise_a_typed_error(config, layer_type: str) -> None:
    with pytest.raises(UnsupportedModelError, match=layer_type) as err:
        check_supported(config)
    assert err.value.layer_type == layer_type


def test_supported_configs_pass_the_check() -> None:
    full = (MistralConfig(sliding_window=None), Qwen2Config(), Qwen3Config(), GPT2Config())
    for config in full:
        check_supported(config)
        assert not has_window(config)
    windowed = (
        MistralConfig(sliding_window=64),
        Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0),
        Gemma2Config(),
        Gemma3TextConfig(),
    )
    for config in windowed:
        check_supported(config)
        assert has_window(config)


def test_unsupported_model_directory_fails_before_loading_weights(tmp_path: Path) -> None:
    DeepseekV3Config().save_pretrained(tmp_path)  # config only, no weights
    with pytest.raises(UnsupportedModelError, match="multi_latent_attention"):
        load_model(str(tmp_path))


def test_a_directory_without_tokenizer_files_names_them_before_reading_weights(
    tmp_path: Path,
) -> None:
    micro_config().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not weights")  # reading it would fail
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    assert str(err.value) == (
        f"{tmp_path} has no tokenizer files (none of: tokenizer.json, tokenizer.model, "
        "spiece.model, vocab.json + merges.txt, vocab.txt); save the tokenizer there with "
        "tokenizer.save_pretrained(dir)"
    )


def test_an_empty_directory_is_not_a_model_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"it has no config\.json"):
        load_model(str(tmp_path))


def test_an_unknown_model_type_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "frobnicator"}')
    with pytest.raises(ModelLoadError, match="model_type 'frobnicator' is unknown to transformers"):
        load_model(str(tmp_path))


def test_unknown_model_name_is_a_load_error() -> None:
    names = r"is not a model: use tiny, smollm2, dummy:NAME, a \.gguf file"
    with pytest.raises(ModelLoadError, match=names):
        load_model("no-such-model-dir")
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model("tiny", dtype="float64")


def test_same_config_other_weights_means_another_namespace(micro: LoadedModel) -> None:
    other = micro_model(seed=2)
    assert other.fingerprint != micro.fingerprint
    assert other.namespace(4).root() != micro.namespace(4).root()
    assert micro.namespace(4) == micro_model(seed=1).namespace(4)
