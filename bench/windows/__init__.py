"""`python -m bench windows`: device blocks a running request holds as decode passes the
window, for a window-only model, a hybrid model and a full-attention control (micro models,
2 layers, block size 4). A bound would be the window's blocks plus one; kvstore keeps every
position of window layers today (docs/ARCHITECTURES.md), so this measures the gap."""

from __future__ import annotations

import argparse
import math

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig, PretrainedConfig

from engine.engine import Engine
from engine.model import BYTE_VOCAB_SIZE, byte_tokenizer, random_model, wrap_model
from engine.request import Request, SamplingParams
from kvstore.config import CacheConfig

BLOCK_SIZE = 4
MICRO = {
    "vocab_size": BYTE_VOCAB_SIZE, "bos_token_id": 256, "eos_token_id": 257, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 1024, "initializer_range": 0.1,
}  # fmt: skip
MODELS = {  # name -> (model_type, config)
    "mistral-window": ("mistral", {"sliding_window": 16}),
    "qwen2-hybrid": ("qwen2", {"use_sliding_window": True, "sliding_window": 16,
                               "max_window_layers": 1}),
    "llama": ("llama", {}),
}  # fmt: skip


def micro_config(name: str) -> PretrainedConfig:
    model_type, values = MODELS[name]
    return AutoConfig.for_model(model_type, **MICRO, **values)


def held_during_decode(arch: str, prompt_len: int, new_tokens: int, marks: list[int]) -> dict:
    """Blocks in the request's table when it has generated each of `marks` tokens."""
    model = wrap_model(random_model(micro_config(arch), seed=0), byte_tokenizer(), arch)
    config = CacheConfig(block_size=BLOCK_SIZE, device="cpu", device_blocks=1024)
    seen: dict[int, int] = {}
    request: Request | None = None

    def on_token(_: int) -> None:
        done = len(request.output)  # the token is in it already
        if done in marks and request.state is not None:
            seen[done] = len(request.state.blocks.block_table)

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    with Engine(model, config) as engine, torch.inference_mode():
        request = Request(list(range(1, prompt_len + 1)), params, on_token=on_token)
        engine.add_requests([request])[0].future.result(600)
    window = getattr(model.model.config, "sliding_window", None)
    return {"window": window, "held": seen}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench windows", description=__doc__)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    marks = sorted({1, 16, 64, args.new_tokens // 2, args.new_tokens})
    table = Table(title=f"blocks held by one request (prompt {args.prompt}, block size 4)")
    for col in ("model", "window", "bound", *[f"after {m}" for m in marks]):
        table.add_column(col, justify="right")
    for arch in MODELS:
        r = held_during_decode(arch, args.prompt, args.new_tokens, marks)
        bound = "-" if r["window"] is None else str(math.ceil(r["window"] / BLOCK_SIZE) + 1)
        held = [str(r["held"].get(m, "?")) for m in marks]
        table.add_row(arch, str(r["window"] or "-"), bound, *held)
    Console(width=120).print(table)
    print("bound: the window's blocks + 1; 'after n': blocks in the table after n new tokens")
    return 0
