"""Micro configs (2 layers, hidden 64) of every architecture family the engine serves.

WINDOWED are sliding-window and hybrid models: their windows (5 to 7 tokens) are shorter
than the test prompts, so a wrong window mask changes the output."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from engine.model.tiny import BYTE_VOCAB_SIZE

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
ROPE16 = {**ROPE_DECODER, "head_dim": 16}
HYBRID = {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]}
# name -> (model_type, config): Gemma 2 softcaps its logits (small caps, so they bite)
WINDOWED: dict[str, tuple[str, dict]] = {
    "gemma2": ("gemma2", {**ROPE16, **HYBRID, "attn_logit_softcapping": 0.5,
                          "final_logit_softcapping": 5.0}),
    "gemma3_text": ("gemma3_text", {**ROPE16, **HYBRID}),
    "mistral-window": ("mistral", {**ROPE16, "sliding_window": 7}),
    "qwen2-window": ("qwen2", {**ROPE_DECODER, "use_sliding_window": True, "sliding_window": 7,
                               "max_window_layers": 0}),
    "phi3-window": ("phi3", {**ROPE_DECODER, "pad_token_id": 258, "sliding_window": 7}),
    "qwen2-hybrid": ("qwen2", {**ROPE_DECODER, "use_sliding_window": True, "sliding_window": 5,
                               "max_window_layers": 1}),
    "cohere2": ("cohere2", {**ROPE16, **HYBRID}),
    "gpt_oss": ("gpt_oss", {**ROPE16, **HYBRID, "num_local_experts": 4,
                            "num_experts_per_tok": 2,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}),
}  # fmt: skip
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
    "gptj": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "rotary_dim": 8},
    "bloom": {"hidden_size": 64, "n_layer": 2, "n_head": 4},  # ALiBi, eager attention only
    "olmo2": ROPE16,
    "granite": ROPE16,
    "starcoder2": {**ROPE16, "sliding_window": None},
    "phi": {**ROPE16, "partial_rotary_factor": 0.5},
    "mixtral": {**ROPE16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    "qwen3_moe": {**ROPE16, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32},
    "cohere": ROPE16,
    "helium": ROPE16,
}  # fmt: skip
# Refused batching, with the reason the engine logs: they are served one request at a time.
SEQUENTIAL = {"falcon-alibi": "step cache: ALiBi built outside a build_alibi_tensor method"}
OTHER = {"falcon-alibi": ("falcon", {**ARCHS["falcon"], "alibi": True})}


def arch_config(name: str) -> PretrainedConfig:
    """The micro config of `name`: a key of ARCHS, WINDOWED or OTHER (init std 0.1)."""
    model_type, values = (name, ARCHS[name]) if name in ARCHS else {**WINDOWED, **OTHER}[name]
    return AutoConfig.for_model(model_type, **COMMON, **values, initializer_range=0.1)


ALL_ARCHS = sorted({*ARCHS, *WINDOWED, *OTHER})
