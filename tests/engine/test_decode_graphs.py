"""Decode steps replayed from captured graphs (engine/loop/graph.py): the static buffers a
captured step reads, and graph decoding that gives the eager path's tokens for every
attention kind the engine batches. On a CPU the graphs are TorchScript traces;
tests/engine/test_cuda.py runs the same comparison with CUDA graphs on a GPU."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from arch_configs import arch_config
from engine_helpers import greedy_matches_reference, micro_cache_config, micro_model

from engine.attention.decode_buffers import DecodeBuffers
from engine.attention.step_row import Row
from engine.loop.engine import Engine
from engine.loop.graph import DecodeGraphs, GraphConfig, GraphError, batch_buckets, width_bucket
from engine.loop.request import SamplingParams
from engine.model.linear import LinearConfig
from engine.model.loading import wrap_model
from engine.model.tiny import byte_tokenizer, random_model

CPU = torch.device("cpu")
SCRATCH = 99
EAGER = GraphConfig("off")
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


# --- the static buffers ---------------------------------------------------------------------


def buffers() -> DecodeBuffers:
    return DecodeBuffers(max_batch=4, max_width=8, block_size=4, scratch_block=SCRATCH, device=CPU)


def test_fill_writes_rows_then_padding_into_the_header_and_the_tables():
    buf = buffers()
    rows = [
        Row([5, 6, 7], start=9, num_new=1),  # position 9: block 7, offset 1
        Row([8], start=2, num_new=1),
        Row([1, 2], start=4, num_new=1, num_shared_blocks=2),  # a cached block: scratch
    ]
    buf.fill(rows, [11, 12, 13], bucket=4, width=4)
    header = [buf.header(field)[:4].tolist() for field in range(5)]
    assert header == [
        [11, 12, 13, 0],  # input ids (padding: 0)
        [9, 2, 4, 0],  # positions
        [7, 8, SCRATCH, SCRATCH],  # write blocks
        [1, 2, 0, 0],  # write offsets
        [10, 3, 5, 1],  # context lengths (padding: the one scratch key)
    ]
    assert buf.tables(4, 4).tolist() == [
        [5, 6, 7, SCRATCH],
        [8, SCRATCH, SCRATCH, SCRATCH],
        [1, 2, SCRATCH, SCRATCH],
        [SCRATCH] * 4,
    ]


def test_a_narrower_step_reuses_the_tables_region_with_its_own_stride():
    buf = buffers()
    buf.fill([Row([5, 6, 7], 9, 1)], [1], bucket=2, width=8)
    buf.fill([Row([3], 0, 1), Row([4], 1, 1)], [1, 2], bucket=2, width=1)
    assert buf.tables(2, 1).tolist() == [[3], [4]]


@pytest.mark.parametrize(
    ("rows", "bucket", "width", "match"),
    [
        ([Row([1, 2], 3, 2)], 1, 2, r"feed \[2\]"),
        ([Row([1, 2, 3], 9, 1)], 1, 2, "reads 3 blocks"),
        ([Row([1], 0, 1)] * 3, 2, 1, "do not fit"),
        ([Row([1], 0, 1)], 8, 1, "do not fit"),
    ],
)
def test_fill_refuses_rows_a_step_cannot_hold(rows, bucket, width, match):
    with pytest.raises(ValueError, match=match):
        buffers().fill(rows, [0] * len(rows), bucket, width)


def test_the_step_batch_masks_come_from_the_context_lengths_on_the_device():
    buf = buffers()
    buf.fill([Row([5, 6, 7], 9, 1), Row([8], 2, 1)], [1, 2], bucket=2, width=4)
    batch = buf.step_batch(2, 4, buf.device_buffer)
    seen = batch.decode_bias[:, 0, 0] == 0  # [rows, 16 keys]
    assert seen[0].nonzero().flatten().tolist() == list(range(10))
    assert seen[1].nonzero().flatten().tolist() == [0, 1, 2]
    window = batch.decode_reads(3).mask[:, 0, 0] == 0  # the 3 keys ending at the query
    assert window[0].nonzero().flatten().tolist() == [7, 8, 9]
    assert batch.decode_index.tolist() == [0, 1]


def test_buckets_pad_batches_and_widths_to_few_shapes():
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(1) == [1]
    assert [width_bucket(n, 48) for n in (1, 2, 3, 5, 17, 40, 48)] == [1, 2, 4, 8, 32, 48, 48]
    assert width_bucket(49, 48) is None


# --- decoding through graphs -----------------------------------------------------------------

PROMPTS = [tokens(n, seed=n) for n in (5, 13, 9, 22, 3)]  # 5 rows: the bucket of 8 pads 3


def windowed(name: str):
    return wrap_model(random_model(arch_config(name), seed=0), byte_tokenizer(), name)


MODELS = {
    "full": lambda: micro_model(seed=11),
    "sliding-window": lambda: windowed("mistral-window"),
    "hybrid": lambda: windowed("qwen2-hybrid"),
    "hybrid-softcap": lambda: windowed("gemma2"),
}


def decode_all(model, graphs: GraphConfig, **cache: object) -> tuple[list[list[int]], object]:
    """The outputs, and the runner's graphs (None: off)."""
    with Engine(model, micro_cache_config(**cache), graph_config=graphs) as engine:
        out = engine.generate(PROMPTS, GREEDY)
        engine.cache.check_integrity()
        return [r.output_token_ids for r in out], engine.runner.graphs


@pytest.mark.parametrize("kind", list(MODELS))
def test_graph_decoding_gives_the_eager_tokens(kind):
    model = MODELS[kind]()
    eager, _ = decode_all(model, EAGER)
    replayed, graphs = decode_all(model, GraphConfig("auto"))
    assert graphs is not None and graphs.disabled is None
    assert graphs.replays >= GREEDY.max_new_tokens - 1  # every decode step of the batch
    assert replayed == eager
    if kind == "full":
        pairs = zip(PROMPTS, replayed, strict=True)
        assert all(greedy_matches_reference(model, p, o) for p, o in pairs)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("kind", ["full", "hybrid"])
def test_a_quantized_pool_replays_its_decode_steps_as_the_eager_ones(kind, kv_dtype):
    """The quantized write (a dtype view would stop a traced step from capturing) replays,
    and its tokens are the eager steps' on the same pool dtype."""
    model = MODELS[kind]()
    eager, _ = decode_all(model, EAGER, kv_cache_dtype=kv_dtype)
    replayed, graphs = decode_all(model, GraphConfig("auto"), kv_cache_dtype=kv_dtype)
    assert graphs is not None and graphs.disabled is None
    assert graphs.replays >= GREEDY.max_new_tokens - 1
    assert replayed == eager


def test_a_step_is_padded_to_its_bucket_and_padding_writes_only_the_scratch_block():
    model = micro_model(seed=12)
    with Engine(model, micro_cache_config(), graph_config=GraphConfig("auto")) as engine:
        runner, graphs = engine.runner, engine.runner.graphs
        # three rows writing blocks 1, 2 and 3: a step of the bucket of 4, one row padding
        rows = [Row([0, 1], 5, 1), Row([2], 3, 1), Row([3], 0, 1)]
        before = engine.cache.pool.kv.clone()
        with torch.inference_mode():
            logits = engine.on_loop(lambda: graphs.run(rows, [7, 8, 9]))
        kv = engine.cache.pool.kv
        same = (kv == before) | (kv.isnan() & before.isnan())  # (never-written memory: NaN)
        changed = (~same).flatten(1).any(1).nonzero().flatten()
    assert logits.shape[0] == 3
    assert list(graphs.graphs) == [(4, 2)]
    assert set(changed.tolist()) == {1, 2, 3, runner.scratch_block}


def test_a_replay_that_differs_from_the_eager_step_turns_graphs_off(monkeypatch, caplog):
    """Control: a graph that returns wrong logits is caught at its first replay; the step's
    answer is the eager one, and later steps run eager."""
    model = micro_model(seed=13)
    eager, _ = decode_all(model, EAGER)
    step = DecodeGraphs._step

    def wrong(self, bucket, width):
        captured = step(self, bucket, width)
        return lambda *inputs: captured(*inputs) + 1.0  # every logit moved

    monkeypatch.setattr(DecodeGraphs, "_step", wrong)
    with caplog.at_level(logging.WARNING, "kvstore.engine"):
        replayed, graphs = decode_all(model, GraphConfig("auto"))
    assert graphs.disabled.startswith("a replay differs from the eager step")
    assert "decode graphs off" in caplog.text
    assert replayed == eager


def test_a_replay_whose_kv_write_is_wrong_turns_graphs_off(monkeypatch):
    """Control: right logits, but the K/V the step left in the pool is not what it wrote."""
    model = micro_model(seed=14)
    capture = DecodeGraphs._capture

    def spoiled(self, bucket, width):
        replay = capture(self, bucket, width)

        def run():
            out = replay()
            blocks, offsets = self.buffers.header(2)[:bucket], self.buffers.header(3)[:bucket]
            self.runner.pool.kv[blocks, :, :, :, offsets] += 1.0
            return out

        return run

    monkeypatch.setattr(DecodeGraphs, "_capture", spoiled)
    _, graphs = decode_all(model, GraphConfig("auto"))
    assert "K/V by" in graphs.disabled


def test_graphs_off_and_graphs_refused_by_the_model(caplog):
    model = micro_model(seed=15)
    with Engine(model, micro_cache_config(), graph_config=EAGER) as engine:
        assert engine.runner.graphs is None
    packed = LinearConfig("onednn")  # oneDNN's packed weights cannot be traced
    with Engine(model, micro_cache_config(), linear_config=packed) as engine:
        assert engine.runner.graphs is None
    with pytest.raises(GraphError, match="packed linears"):
        Engine(model, micro_cache_config(), linear_config=packed, graph_config=GraphConfig("on"))
    with pytest.raises(ValueError, match="cuda_graphs"):
        GraphConfig("always")


def test_a_prompt_only_request_replays_nothing():
    model = micro_model(seed=16)
    with Engine(model, micro_cache_config(), graph_config=GraphConfig("auto")) as engine:
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=1, ignore_eos=True))
        assert engine.runner.graphs.replays == 0
