"""Every architecture family through the batched engine against HF greedy `generate`, cold
and warm; the table in docs/ARCHITECTURES.md is this test's output.

`KVSTORE_WRITE_DOCS=1 pytest tests/engine/test_architectures.py` rewrites the table; without
it, a table that differs from what the engine does now fails the last test."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from arch_configs import ALL_ARCHS, SEQUENTIAL, WINDOWED, arch_config
from engine_helpers import micro_cache_config

from engine.loop.engine import Engine
from engine.loop.request import SamplingParams
from engine.loop.scheduler_config import SchedulerConfig
from engine.model.loading import LoadedModel, wrap_model
from engine.model.tiny import byte_tokenizer, random_model

DOC = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURES.md"
BEGIN, END = "<!-- generated: begin -->", "<!-- generated: end -->"
NEW_TOKENS = 10
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
SEEN: dict[str, tuple[str, ...]] = {}  # arch -> (model class, served, layers, held)
# blocks that cold and warm runs of the four prompts drop from the index, window 7, blocks of
# 4: the same for every window-only model (the keys, not the weights, decide)
WINDOW_ONLY_DROPS = 12
# window parts (of blocks of 4) that a hybrid model's index lets go of over those runs, by
# window: the full layers' parts stay cached
HYBRID_DROPS = {5: 14, 6: 12}
HYBRID_HOLDS = "full layers: the whole sequence; window layers: the window's blocks"


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def hf_generate(model: LoadedModel, prompt: list[int]) -> list[int]:
    """HF greedy generate, past EOS as the engine's `ignore_eos` (min_new_tokens would
    forbid EOS instead)."""
    model.model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def layers_of(config: object) -> str:
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" in types:
        kinds = "all window" if "full_attention" not in types else "window + full"
        return f"{kinds} (window {config.sliding_window})"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) is not False:
        return f"all window (window {window})"
    return "full"


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_each_architecture_is_served_batched_and_equals_hf_generate(arch: str, caplog) -> None:
    model = wrap_model(random_model(arch_config(arch), seed=0), byte_tokenizer(), arch)
    prompts = [tokens(n, seed=60 + n) for n in (6, 13, 9, 23)]
    expected = [hf_generate(model, p) for p in prompts]
    sched = SchedulerConfig(max_num_batched_tokens=16)  # chunked prefill beside decodes
    caplog.set_level("WARNING")
    with Engine(model, micro_cache_config(), scheduler_config=sched) as engine:
        cold = engine.generate(prompts, GREEDY)
        warm = engine.generate(prompts, GREEDY)
        mode = engine.mode
        drops = engine.cache.metrics.get("windowed_out_blocks_total")
    assert [r.output_token_ids for r in cold] == expected
    assert [r.output_token_ids for r in warm] == expected
    assert [r.cached_tokens for r in warm] == [4, 12, 8, 20]
    if arch in SEQUENTIAL:
        assert mode == "sequential"
        assert SEQUENTIAL[arch] in caplog.text
    else:
        assert mode == "paged", caplog.text
    # a window-only model's requests let go of the blocks behind their window (window 7)
    held, want = "the whole sequence", 0
    if engine.cache.kind.splits_blocks:  # a hybrid model: two planes
        held, want = HYBRID_HOLDS, HYBRID_DROPS[engine.cache.window]
    elif engine.cache.window:
        held, want = "the window's blocks", WINDOW_ONLY_DROPS
    assert drops == want
    runner = "one request at a time" if mode == "sequential" else "batched"
    if mode == "paged":
        runner += "" if engine.runner.how == "attention interface" else " (step cache)"
    SEEN[arch] = (type(model.model).__name__, runner, layers_of(model.model.config), held)


def table() -> str:
    rows = [
        "| Architecture | Class | Layers | Served | A request holds | Why not batched |",
        "|---|---|---|---|---|---|",
    ]
    for arch in ALL_ARCHS:
        cls, served, layers, held = SEEN[arch]
        why = SEQUENTIAL.get(arch, "")
        rows.append(f"| {arch} | {cls} | {layers} | {served} | {held} | {why} |")
    return "\n".join(rows)


def test_the_architecture_table_in_the_docs_is_this_tests_output() -> None:
    if len(SEEN) != len(ALL_ARCHS):
        pytest.skip("needs every architecture test of this module in the same run")
    assert len(ALL_ARCHS) >= 20 and len(WINDOWED) >= 5
    text = DOC.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    fresh = f"{head}{BEGIN}\n{table()}\n{END}{tail}"
    if os.environ.get("KVSTORE_WRITE_DOCS") == "1":
        DOC.write_text(fresh)
        return
    assert text == fresh, "docs/ARCHITECTURES.md is stale: rerun with KVSTORE_WRITE_DOCS=1"
