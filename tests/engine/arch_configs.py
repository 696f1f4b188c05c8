"""Micro configs (2 layers, hidden 64) of every architecture family the engine serves."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from engine.model import BYTE_VOCAB_SIZE

COMMON = {"vocab_size": BYTE_VOCAB_SIZE, "bos_token_id": 256, "eos_token_id": 257}
ROPE_DECODER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
ARCHS: dict[str, dict] = {
    "llama": {**ROPE_DECODER, "head_dim": 16},
    "qwen2": {**ROPE_DECODER, "use_sliding_window": False},
    "qwen3": {**ROPE_DECODER, "head_dim": 16, "use_sliding_window": False},
    "mistral": {**ROPE_DECODER, "head_dim": 16, "sliding_window": None},
    "phi3": {**ROPE_DECODER, "pad_token_id": 258, "sliding_window": None},
    "gemma": {**ROPE_DECODER, "head_dim": 16},
    "stablelm": {**ROPE_DECODER},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256},
    "opt": {
        "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": 256, "word_embed_proj_dim": 64, "pad_token_id": 1,
    },
    "gpt_neox": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 256,
    },
    "falcon": {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "new_decoder_architecture": False, "multi_query": True, "alibi": False,
        "max_position_embeddings": 256,
    },
    "gpt_bigcode": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256},
    # no SDPA in transformers: loaded with eager attention
    "gptj": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "rotary_dim": 8},
    "bloom": {"hidden_size": 64, "n_layer": 2, "n_head": 4},
}  # fmt: skip


def arch_config(name: str) -> PretrainedConfig:
    return AutoConfig.for_model(name, **COMMON, **ARCHS[name])
