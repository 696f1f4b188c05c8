"""A small GGUF file written with the `gguf` package's writer: a random tiny Llama (2 layers,
hidden 64, fp32 tensors) with a byte-level BPE vocabulary and a ChatML template, laid out
as llama.cpp writes Llama files. Conversion tests need no download."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from engine.model.tiny import bytes_to_unicode

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MERGES = ("Ġ t", "h e", "Ġt he")


def vocabulary() -> tuple[list[str], list[int]]:
    merged = [m.replace(" ", "") for m in MERGES]
    table = bytes_to_unicode()  # what a byte-level BPE vocabulary holds
    tokens = [*SPECIALS, *(table[b] for b in range(256)), *merged]
    types = [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (
        len(tokens) - len(SPECIALS)
    )
    return tokens, [int(t) for t in types]


def write_tiny_llama_gguf(path: Path, seed: int = 0, arch: str = "llama") -> Path:
    """A complete GGUF file of a random tiny Llama at `path` (`arch` names another
    architecture in the header, for the unsupported-architecture test)."""
    tokens, types = vocabulary()
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama-test")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, shape in _tensor_shapes(len(tokens)):
        scale = 1.0 if name.endswith("norm.weight") else 0.1
        values = np.ones(shape) if scale == 1.0 else rng.normal(0, scale, shape)
        writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tensor_shapes(vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes (numpy order: [out, in]) as llama.cpp names them."""
    head_dim = HIDDEN // HEADS
    shapes = [("token_embd.weight", (vocab, HIDDEN)), ("output_norm.weight", (HIDDEN,)),
              ("output.weight", (vocab, HIDDEN))]  # fmt: skip
    for i in range(LAYERS):
        b = f"blk.{i}."
        shapes += [
            (b + "attn_norm.weight", (HIDDEN,)),
            (b + "attn_q.weight", (HIDDEN, HIDDEN)),
            (b + "attn_k.weight", (KV_HEADS * head_dim, HIDDEN)),
            (b + "attn_v.weight", (KV_HEADS * head_dim, HIDDEN)),
            (b + "attn_output.weight", (HIDDEN, HIDDEN)),
            (b + "ffn_norm.weight", (HIDDEN,)),
            (b + "ffn_gate.weight", (FFN, HIDDEN)),
            (b + "ffn_up.weight", (FFN, HIDDEN)),
            (b + "ffn_down.weight", (HIDDEN, FFN)),
        ]
    return shapes
