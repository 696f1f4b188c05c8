"""`python -m bench windows`: device blocks a running request holds as decode passes the
window, for window-only models, a hybrid model and a full-attention control (micro models,
2 layers, block size 4), and the pool's blocks in use beside them. A window-only model's
request drops the blocks that slid out of its window (docs/ARCHITECTURES.md): it holds at
most the window's blocks plus one. A hybrid model's full layers read the whole prefix, so
its request holds every block, as a full model's does."""

from __future__ import annotations

import argparse
import math

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig, PretrainedConfig

from engine.engine import Engine
from engine.model import (
    BYTE_VOCAB_SIZE,
    byte_tokenizer,
    random_model,
    shared_window,
    wrap_model,
)
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
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 16,
                               "max_window_layers": 0}),
    "qwen2-hybrid": ("qwen2", {"use_sliding_window": True, "sliding_window": 16,
                               "max_window_layers": 1}),
    "llama": ("llama", {}),
}  # fmt: skip


def micro_config(name: str) -> PretrainedConfig:
    model_type, values = MODELS[name]
    return AutoConfig.for_model(model_type, **MICRO, **values)


def held_during_decode(arch: str, prompt_len: int, new_tokens: int, marks: list[int]) -> dict:
    """Blocks the request holds, and pool blocks in use (the engine's scratch block aside),
    when it has generated each of `marks` tokens."""
    model = wrap_model(random_model(micro_config(arch), seed=0), byte_tokenizer(), arch)
    config = CacheConfig(block_size=BLOCK_SIZE, device="cpu", device_blocks=1024)
    seen: dict[int, int] = {}
    in_use: dict[int, int] = {}
    request: Request | None = None

    def on_token(_: int) -> None:
        done = len(request.output)  # the token is in it already
        if done in marks and request.state is not None:
            seen[done] = sum(b is not None for b in request.state.blocks.block_table)
            in_use[done] = pool.num_blocks - pool.num_free_blocks - 1

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    with Engine(model, config) as engine, torch.inference_mode():
        pool = engine.cache.pool
        request = Request(list(range(1, prompt_len + 1)), params, on_token=on_token)
        engine.add_requests([request])[0].future.result(600)
    window = getattr(model.model.config, "sliding_window", None)
    return {"window": window, "held": seen, "in_use": in_use}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench windows", description=__doc__)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    marks = sorted({1, 16, 64, args.new_tokens // 2, args.new_tokens})
    title = f"blocks held by one request / pool blocks in use (prompt {args.prompt}, block size 4)"
    table = Table(title=title)
    for col in ("model", "window", "layers", "bound", *[f"after {m}" for m in marks]):
        table.add_column(col, justify="right")
    for arch in MODELS:
        r = held_during_decode(arch, args.prompt, args.new_tokens, marks)
        windowed = shared_window(micro_config(arch)) is not None
        bound = str(math.ceil(r["window"] / BLOCK_SIZE) + 1) if windowed else "-"
        layers = "window" if windowed else "window + full" if r["window"] else "full"
        cells = [f"{r['held'].get(m, '?')} / {r['in_use'].get(m, '?')}" for m in marks]
        table.add_row(arch, str(r["window"] or "-"), layers, bound, *cells)
    Console(width=130).print(table)
    print("bound: a window-only model's window in blocks + 1; 'after n': after n new tokens")
    return 0
