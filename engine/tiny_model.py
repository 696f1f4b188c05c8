"""The pinned `tiny` model: a Llama-style model whose weights come from a fixed seed, with a
byte-level tokenizer (token id = byte value) and a plain chat template. It needs no download:
tests, demos and benchmarks run on it anywhere."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from engine.model_files import attn_implementation

TINY_NAME = "tiny"
TINY_SEED = 0
BOS, EOS, PAD, END_OF_TURN = "<|bos|>", "<|eos|>", "<|pad|>", "<|end_of_turn|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, END_OF_TURN)  # ids 256.. after the 256 bytes
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "<|end_of_turn|>\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def tiny_config() -> LlamaConfig:
    """The pinned `tiny` model: Llama-style, 8 layers, hidden 512, GQA 8/2, byte vocabulary."""
    return LlamaConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        initializer_range=0.1,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    )


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table that the ByteLevel pre-tokenizer uses."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: token id = byte value; specials 256..259; a plain chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, 256)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[END_OF_TURN],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def random_model(config: PretrainedConfig, seed: int = TINY_SEED) -> PreTrainedModel:
    """A causal LM with weights drawn from `seed` (init std = config.initializer_range)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation(config)
        )
