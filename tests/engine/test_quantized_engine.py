"""The engine on a quantized pool (`kv_cache_dtype` int8, fp8_e4m3): a hit reads exactly
what the miss that wrote it read, on every architecture the engine batches; the models it
cannot serve that way are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from arch_configs import ALL_ARCHS, arch_config
from engine_helpers import close_to_reference, micro_cache_config, micro_model, reference_logits

from engine.loop.engine import Engine
from engine.loop.request import SamplingParams
from engine.loop.scheduler_config import SchedulerConfig
from engine.model.loading import wrap_model
from engine.model.tiny import byte_tokenizer, random_model
from kvstore.config import CODEC_TOLERANCE, ConfigError

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
# Falcon with ALiBi outside a build_alibi_tensor method runs one request at a time, whose
# forward attends exact K/V (tests/engine/arch_configs.py SEQUENTIAL)
REFUSED = {"falcon-alibi"}


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_each_batched_architecture_hits_what_its_miss_read(arch: str) -> None:
    model = wrap_model(random_model(arch_config(arch), seed=0), byte_tokenizer(), arch)
    config = micro_cache_config(kv_cache_dtype="int8")
    sched = SchedulerConfig(max_num_batched_tokens=16)  # chunked prefill beside decodes
    if arch in REFUSED:
        with pytest.raises(ConfigError, match="kv_cache_dtype") as info:
            Engine(model, config, scheduler_config=sched).close()
        assert "auto" in str(info.value)
        return
    prompts = [tokens(n, seed=60 + n) for n in (6, 13, 9, 23)]
    with Engine(model, config, scheduler_config=sched) as engine:
        assert engine.mode == "paged"
        cold = engine.generate(prompts, GREEDY)
        warm = engine.generate(prompts, GREEDY)
    assert [r.output_token_ids for r in warm] == [r.output_token_ids for r in cold]
    assert [r.cached_tokens for r in warm] == [4, 12, 8, 20]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_a_hit_equals_its_miss_within_fp32_and_no_cache_within_the_codec(kv_dtype) -> None:
    model = micro_model(seed=1)
    prompt = tokens(45, seed=3)
    config = micro_cache_config(kv_cache_dtype=kv_dtype)
    with Engine(model, config) as engine:
        miss, cached_miss = engine.prefill_logits(prompt)
        hit, cached_hit = engine.prefill_logits(prompt)
        assert (cached_miss, cached_hit) == (0, 44)
        assert close_to_reference(hit, miss)  # the exact contract: both read the same K/V
        codec = {"int8": "int8", "fp8_e4m3": "fp8"}[kv_dtype]
        ref = reference_logits(model, prompt)[-1]
        assert close_to_reference(hit, ref, CODEC_TOLERANCE[codec])
        assert not close_to_reference(hit, ref)  # quantized: not the unquantized logits
        # control: one cached block's values changed, the hit no longer equals the miss
        found = engine.cache.lookup(prompt)
        try:
            engine.cache.pool.kv[found.block_ids[3]] = torch.zeros_like(engine.cache.pool.kv[0])
        finally:
            engine.cache.release(found)
        perturbed, _ = engine.prefill_logits(prompt)
        assert not close_to_reference(perturbed, miss)


def test_the_per_request_path_is_refused_on_a_quantized_pool() -> None:
    """It would attend exact K/V: its misses would not be what the pool's hits read."""
    with Engine(micro_model(seed=1), micro_cache_config(kv_cache_dtype="int8")) as engine:
        with pytest.raises(ConfigError, match="per-request path"):
            engine.run(tokens(20, seed=4), GREEDY)
        assert engine.generate([tokens(20, seed=4)], GREEDY)[0].output_token_ids


def test_health_names_a_quantized_pool_and_leaves_auto_out_for_older_routers() -> None:
    from engine.server.config import ServerConfig
    from engine.server.service import cache_info

    for kv_dtype in ("auto", "int8"):
        with Engine(micro_model(seed=1), micro_cache_config(kv_cache_dtype=kv_dtype)) as e:
            namespace = cache_info(e, ServerConfig(served_model_name="micro"))["namespace"]
        assert namespace.get("kv_cache_dtype", "auto") == kv_dtype
        assert ("kv_cache_dtype" in namespace) == (kv_dtype != "auto")


@pytest.mark.parametrize("arch", ["gemma2", "qwen2-hybrid"])
def test_a_hybrid_models_quantized_window_plane_comes_back_from_lmdb_as_its_miss_read(
    arch: str, tmp_path
) -> None:
    """Both planes of an int8 hybrid pool go to LMDB as one payload per block and come back
    into a fresh pool: the hit's logits are its miss's; a window-plane byte changed is not."""
    model = wrap_model(random_model(arch_config(arch), seed=0), byte_tokenizer(), arch)
    prompt = tokens(40, seed=7)
    config = micro_cache_config(
        kv_cache_dtype="int8", lmdb_dir=str(tmp_path), lmdb_write_policy="write-through"
    )
    with Engine(model, config) as engine:
        miss, cached = engine.prefill_logits(prompt)
        assert cached == 0
    with Engine(model, config) as engine:
        assert engine.mode == "paged"
        hit, cached = engine.prefill_logits(prompt)
        assert cached == 36 and engine.cache.metrics.get("promoted_blocks_total") == 9
        assert close_to_reference(hit, miss)
        assert close_to_reference(hit, reference_logits(model, prompt)[-1], CODEC_TOLERANCE["int8"])
        found = engine.cache.lookup(prompt)  # control: block 8's window part, one value
        try:
            pool = engine.cache.pool
            slot = int(pool.window.slot[found.block_ids[8]])
            pool.window.kv.view(torch.uint8)[slot, 0, 0, 0, 3] ^= 0x40
        finally:
            engine.cache.release(found)
        perturbed, _ = engine.prefill_logits(prompt)
        assert not close_to_reference(perturbed, miss)


@pytest.mark.parametrize("arch", ["bloom", "falcon", "gemma2"])
def test_a_step_cache_or_hybrid_miss_reads_its_own_keys_quantized_as_its_hit_does(arch) -> None:
    """The miss attends its own new K/V read back from the pool (dequantized), so its logits
    are its hit's within fp32; both are the quantized ones, not the reference's."""
    model = wrap_model(random_model(arch_config(arch), seed=0), byte_tokenizer(), arch)
    prompt = tokens(37, seed=9)
    with Engine(model, micro_cache_config(kv_cache_dtype="int8")) as engine:
        miss, cached_miss = engine.prefill_logits(prompt)
        hit, cached_hit = engine.prefill_logits(prompt)
    assert (cached_miss, cached_hit) == (0, 36)
    assert close_to_reference(hit, miss)
    ref = reference_logits(model, prompt)[-1]
    assert close_to_reference(miss, ref, CODEC_TOLERANCE["int8"])
    assert not torch.equal(miss, ref)
