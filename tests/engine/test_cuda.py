"""On a GPU only (CI has none: run with KVSTORE_TEST_DEVICE=cuda on a machine with one, as
docs/BENCHMARKS.md's GPU figures were): the pool and the model meet on one device however it
was named, so the engine batches on paged attention and loads tier hits layer by layer."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    close_to_reference,
    greedy_matches_reference,
    micro_cache_config,
    micro_model,
    reference_logits,
)

from engine.loop.engine import Engine
from engine.loop.request import SamplingParams
from kvstore.device.pool import resolve_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model():
    loaded = micro_model()
    loaded.model.to("cuda")
    return loaded


def test_cuda_without_an_index_names_the_device_a_model_reports():
    assert resolve_device("cuda") == torch.zeros(1, device="cuda").device
    assert resolve_device("auto") == resolve_device("cuda")


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "auto"])
def test_a_pool_named_any_way_serves_a_cuda_model_batched(model, name):
    prompts = [list(range(3, 30)), list(range(40, 61))]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    config = micro_cache_config(device=name, memory_cache_gb=0.01, layer_loads=True)
    with Engine(model, config) as engine:
        assert engine.runner is not None  # paged attention, not one request at a time
        assert engine.cache.promoter.loader is not None  # with its loader's copy stream
        outputs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert greedy_matches_reference(model, prompt, out.output_token_ids)


@pytest.mark.parametrize("layer_loads", [False, True], ids=["whole", "layered"])
def test_a_tier_hit_reaches_a_cuda_pool_and_gives_the_reference_output(model, layer_loads):
    prompt = list(range(3, 44))  # 10 whole blocks of 4, then one token
    config = micro_cache_config(
        device="cuda", memory_cache_gb=0.01, memory_write_policy="write-through",
        layer_loads=layer_loads,
    )  # fmt: skip
    reference = reference_logits(model, prompt)[-1]
    with Engine(model, config) as engine:
        engine.prefill_logits(prompt)
        engine.on_loop(lambda: (engine.cache.flush(), engine.cache.evict_device()))
        pre = engine.prefill(prompt)  # whole reads: one staged transfer; layered: the loader
        engine.cache.check_integrity()
    assert pre.cached_by_tier == {"memory": 40}
    assert close_to_reference(pre.logits, reference)


def cuda_model(name: str):
    from arch_configs import arch_config

    from engine.model.loading import wrap_model
    from engine.model.tiny import byte_tokenizer, random_model

    if name == "llama":
        loaded = micro_model()
    else:
        loaded = wrap_model(random_model(arch_config(name), seed=0), byte_tokenizer(), name)
    loaded.model.to("cuda")
    return loaded


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("name", ["llama", "mistral-window", "qwen2-hybrid", "gemma2"])
def test_cuda_graph_decoding_gives_the_eager_tokens(name, kv_cache_dtype):
    """Every attention kind the engine batches (full, sliding window, hybrid; Gemma 2's
    softcapping), with the model's K/V or a quantized pool's (quantized in the step):
    CUDA-graph decode steps give the eager path's greedy tokens."""
    from engine.loop.graph import GraphConfig

    model = cuda_model(name)
    prompts = [list(range(3, 3 + n)) for n in (5, 13, 9, 22, 3)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outputs = {}
    for mode in ("off", "on"):
        config = micro_cache_config(device="cuda", kv_cache_dtype=kv_cache_dtype)
        with Engine(model, config, graph_config=GraphConfig(mode)) as engine:
            outputs[mode] = [r.output_token_ids for r in engine.generate(prompts, params)]
            graphs = engine.runner.graphs
    assert graphs is not None and graphs.disabled is None and graphs.replays >= 11
    assert outputs["on"] == outputs["off"]


@pytest.mark.parametrize("quant", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_a_cuda_pool_quantizes_each_token_as_the_tier_codec_does(quant):
    """CUDA divides by a Python number through its reciprocal, which rounds some scales to
    another bfloat16 than the codec's exact division: the pool divides by a tensor."""
    from kvstore.device.quant_kv import quantize_tokens
    from kvstore.entry.quant import quantize

    g = torch.Generator().manual_seed(5)
    # [layers, 2, heads, tokens, dim]: 2**21 scales over 2**-20..2**20, of which the
    # reciprocal rounds 2 (int8) and 16 (fp8) to another bfloat16 (checked on the CPU)
    kv = torch.randn(4, 2, 4, 2**16, 8, generator=g) * torch.exp2(
        torch.randint(-20, 20, (4, 2, 4, 2**16, 1), generator=g).float()
    )
    values, scales = quantize_tokens(kv.cuda(), quant)
    bits, want = quantize(kv, quant)
    assert torch.equal(scales.cpu().view(torch.int16), torch.from_numpy(bits.view("int16")))
    assert torch.equal(values.cpu().view(torch.uint8), torch.from_numpy(want.view("uint8")))
