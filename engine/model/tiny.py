"""The pinned `tiny` model: a Llama-style model whose weights come from a fixed seed, with a
byte-level tokenizer (token id = byte value, engine/model/tokenizer.py) and a plain chat
template. It needs no download: tests, demos and benchmarks run on it anywhere."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel

from engine.model.files import attn_implementation
from engine.model.tokenizer import (  # the byte tokenizer, importable from here too
    BYTE_VOCAB_SIZE,
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TINY_NAME,
    byte_tokenizer,
    bytes_to_unicode,
)

__all__ = [
    "BYTE_VOCAB_SIZE",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TINY_NAME",
    "TINY_SEED",
    "byte_tokenizer",
    "bytes_to_unicode",
    "micro_config",
    "random_model",
    "tiny_config",
]

TINY_SEED = 0


def _byte_llama(**shape: int) -> LlamaConfig:
    """A Llama-style config over the byte vocabulary, of the given shape."""
    return LlamaConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        **shape,
    )


def tiny_config() -> LlamaConfig:
    """The pinned `tiny` model: Llama-style, 8 layers, hidden 512, GQA 8/2, byte vocabulary."""
    return _byte_llama(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )


def micro_config() -> LlamaConfig:
    """The micro model of tests and fault runs: 2 layers, hidden 64, GQA 4/2, 256 positions."""
    return _byte_llama(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )


def random_model(config: PretrainedConfig, seed: int = TINY_SEED) -> PreTrainedModel:
    """A causal LM with weights drawn from `seed` (init std = config.initializer_range)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation(config)
        )
