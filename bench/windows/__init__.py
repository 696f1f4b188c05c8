"""`python -m bench windows`: device blocks a running request holds as decode passes the
window, for window-only models, a hybrid model and a full-attention control (micro models,
2 layers, block size 4), and the pool's blocks in use beside them. A window-only model's
request drops the blocks that slid out of its window (docs/ARCHITECTURES.md): it holds at
most the window's blocks plus one. A hybrid model's full layers read the whole prefix, so
its request holds every block's full layers; their window layers' part is in the pool's
window plane, and the request holds that part of its window's blocks only (plus one)."""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig, PretrainedConfig

from engine.loop.engine import Engine
from engine.loop.request import Request, SamplingParams
from engine.model.loading import (
    BYTE_VOCAB_SIZE,
    byte_tokenizer,
    random_model,
    shared_window,
    wrap_model,
)
from kvstore.block_tables import SeqBlocks
from kvstore.config import CacheConfig
from kvstore.units import cdiv

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
    # 1 full layer and 5 window layers, Gemma 3's mix
    "qwen2-hybrid-5:1": ("qwen2", {"use_sliding_window": True, "sliding_window": 16,
                                   "max_window_layers": 1, "num_hidden_layers": 6}),
    "llama": ("llama", {}),
}  # fmt: skip


def micro_config(name: str) -> PretrainedConfig:
    model_type, values = MODELS[name]
    return AutoConfig.for_model(model_type, **(MICRO | values))


def held_during_decode(arch: str, prompt_len: int, new_tokens: int, marks: list[int]) -> dict:
    """When the request has generated each of `marks` tokens: the blocks it holds
    ("held"; a hybrid model's: their full layers), the window-layer parts of those
    ("window_held"; a window-only model's: every block it holds), the pool's blocks in use
    ("in_use", the engine's scratch block aside) and window-layer parts in use
    ("window_in_use"), its KV bytes held ("bytes") and those of
    its whole sequence in every layer ("whole_bytes")."""
    model = wrap_model(random_model(micro_config(arch), seed=0), byte_tokenizer(), arch)
    config = CacheConfig(block_size=BLOCK_SIZE, device="cpu", device_blocks=1024)
    names = ("held", "window_held", "in_use", "window_in_use", "bytes", "whole_bytes")
    seen: dict[str, dict[int, int]] = {name: {} for name in names}
    request: Request | None = None

    def on_token(_: int) -> None:
        done = len(request.output)  # the token is in it already
        if done in marks and request.state is not None:
            for name, value in _held(engine, request.state.blocks).items():
                seen[name][done] = value

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    with Engine(model, config) as engine, torch.inference_mode():
        request = Request(list(range(1, prompt_len + 1)), params, on_token=on_token)
        engine.add_requests([request])[0].future.result(600)
    window = getattr(model.model.config, "sliding_window", None)
    return {"window": window, **seen}


def _held(engine: Engine, blocks: SeqBlocks) -> dict[str, int]:
    """A running request's blocks, their window parts, the pool's blocks in use and the
    request's KV bytes."""
    pool = engine.cache.pool
    held = sum(b is not None for b in blocks.block_table)
    per_layer = pool.bytes_per_block // pool.layout.num_layers
    in_use = pool.num_blocks - pool.num_free_blocks - 1
    if pool.window is None:
        window_held = held if engine.cache.window else 0
        window_in_use = in_use if engine.cache.window else 0
        size = held * pool.bytes_per_block
    else:
        window_held = held - blocks.num_window_dropped
        window_in_use = pool.window.num_slots - pool.window.num_free - 1
        size = per_layer * (held * len(pool.full_layers) + window_held * len(pool.window_layers))
    whole = len(blocks.block_table) * pool.bytes_per_block
    return {
        "held": held, "window_held": window_held, "in_use": in_use,
        "window_in_use": window_in_use, "bytes": size, "whole_bytes": whole,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench windows", description=__doc__)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    marks = sorted({1, 16, 64, args.new_tokens // 2, args.new_tokens})
    title = (
        "blocks one request holds / their window-layer parts / pool blocks in use "
        f"(prompt {args.prompt}, block size 4)"
    )
    table = Table(title=title)
    columns = ("model", "window", "layers", "bound", *[f"after {m}" for m in marks], "KiB held")
    for col in columns:
        table.add_column(col, justify="right")
    for arch in MODELS:
        r = held_during_decode(arch, args.prompt, args.new_tokens, marks)
        table.add_row(arch, str(r["window"] or "-"), *_cells(arch, r, marks))
    Console(width=150).print(table)
    print(
        "bound: the window in blocks + 1, for the blocks (window-only) or window-layer parts "
        "(hybrid) a request holds; 'after n': after n new tokens; KiB held: the request's KV "
        "after the last mark / its whole sequence's in every layer"
    )
    return 0


def _cells(arch: str, r: dict, marks: list[int]) -> list[str]:
    config = micro_config(arch)
    windowed = shared_window(config) is not None
    full = len([t for t in getattr(config, "layer_types", ()) if t == "full_attention"])
    layers = "window" if windowed else f"{config.num_hidden_layers - full} window + {full} full"
    layers = layers if r["window"] else "full"
    bound = str(cdiv(r["window"], BLOCK_SIZE) + 1) if r["window"] else "-"
    cells = [
        f"{r['held'].get(m, '?')} / {r['window_held'].get(m, '?')} / {r['in_use'].get(m, '?')}"
        for m in marks
    ]
    last = marks[-1]
    kib = f"{r['bytes'].get(last, 0) / 1024:.0f} / {r['whole_bytes'].get(last, 0) / 1024:.0f}"
    return [layers, bound, *cells, kib]
