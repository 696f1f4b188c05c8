"""`dummy:NAME` (engine/model/dummy.py): a real model's shape with seeded weights. The shapes
have the named models' parameter counts, the weights are small, seeded and the same on every
load, and a saved copy loads as the same model (what a peer serves). The tokenizer here is a
stand-in placed where the SmolLM2 one is kept (tests/integration/test_smollm2.py checks the
real one): these tests need no download."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.commands import check_model_flag
from engine.loop.engine import Engine
from engine.loop.request import SamplingParams
from engine.model.dummy import DUMMY_HIGH, SHAPES, dummy_config, dummy_shape, save_dummy
from engine.model.files import ModelLoadError
from engine.model.loading import load_model
from engine.model.tiny import byte_tokenizer
from kvstore.config import CacheConfig

# parameters of each model as published (embeddings counted once where tied)
PUBLISHED = {
    "smollm2-135m": 134_515_008,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-0.5b": 494_032_768,
}


@pytest.fixture
def tokenizer_cache(tmp_path, monkeypatch) -> Path:
    """A cache whose SmolLM2 tokenizer directory holds a stand-in."""
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path))
    byte_tokenizer().save_pretrained(tmp_path / "tokenizers" / "smollm2")
    return tmp_path


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_shape_has_the_named_models_parameters(shape):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(dummy_config(shape))
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[shape]


def test_a_dummy_model_is_seeded_small_and_the_same_on_every_load(tokenizer_cache):
    first, second = load_model("dummy:smollm2-135m"), load_model("dummy:smollm2-135m")
    params = dict(first.model.named_parameters())
    assert first.dtype == torch.float32  # `auto` on a CPU
    assert all(p.abs().max() <= DUMMY_HIGH for p in params.values())
    assert all(p.std() > DUMMY_HIGH / 4 for p in params.values())  # drawn, not constant
    assert first.model.lm_head.weight is first.model.model.embed_tokens.weight  # tied
    for name, p in second.model.named_parameters():
        assert torch.equal(p, params[name]), name
    assert first.fingerprint == second.fingerprint
    assert first.layout.num_layers == 30 and first.layout.num_kv_heads == 3
    bf16 = load_model("dummy:smollm2-135m", dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16 and bf16.fingerprint != first.fingerprint


def test_a_saved_dummy_loads_as_the_same_model_and_serves(tokenizer_cache, tmp_path):
    dummy = load_model("dummy:smollm2-135m")
    saved = load_model(str(save_dummy(dummy.model, dummy.tokenizer, tmp_path / "peer")))
    ids = torch.tensor([[5, 9, 200, 31, 7]])
    with torch.inference_mode():
        assert torch.equal(dummy.model(ids).logits, saved.model(ids).logits)
    config = CacheConfig(block_size=16, device_blocks=64)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with Engine(dummy, config) as engine:
        first = engine.generate([[5, 9, 200, 31, 7] * 8], params)[0]
        again = engine.generate([[5, 9, 200, 31, 7] * 8], params)[0]
    assert again.cached_tokens == 40  # 2 whole blocks, and 8 tokens of the kept tail
    assert again.output_token_ids == first.output_token_ids


def test_an_unknown_shape_is_named_with_the_shapes_there_are():
    with pytest.raises(ModelLoadError, match=r"dummy:llama-3\.1-8b"):
        dummy_shape("dummy:llama-9")
    with pytest.raises(ModelLoadError, match=r"^--model 'dummy:nope' is not a dummy model"):
        check_model_flag("dummy:nope")
    check_model_flag("dummy:llama-3.2-1b")  # a known one passes, nothing loaded
    assert dummy_shape("smollm2") is None
