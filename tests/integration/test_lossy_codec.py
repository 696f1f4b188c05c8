"""A lossy tier codec is held to its own tolerance against the no-cache reference."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from engine_helpers import close_to_reference, micro_cache_config, micro_model, reference_logits

from engine.loop.engine import Engine
from kvstore.config import CODEC_TOLERANCE


def test_each_lossy_tier_codec_stays_within_its_tolerance_and_zstd_is_exact(tmp_path):
    model = micro_model(seed=1)
    prompt = np.random.default_rng(3).integers(0, 256, 45).tolist()
    ref = reference_logits(model, prompt)[-1]
    got = {}
    for codec in ("fp16", "bf16", "int8", "fp8", "zstd"):
        config = micro_cache_config(lmdb_dir=str(tmp_path / codec), codec=codec)
        with Engine(model, config) as writer:
            writer.prefill_logits(prompt)
        with Engine(model, config) as reader:  # an empty pool: the prefix comes from LMDB
            logits, cached = reader.prefill_logits(prompt)
        assert cached == 44
        assert close_to_reference(logits, ref, CODEC_TOLERANCE[codec])
        got[codec] = logits
    # the lossy codecs are real: they move the logits where the lossless codec does not, each
    # coarser one more: fp16 (11 significant bits), bf16 (8), int8 (a step per token), fp8 (4)
    moved = [float((got[c] - got["zstd"]).abs().max()) for c in ("fp16", "bf16", "int8", "fp8")]
    assert 1e-5 < moved[0] < moved[1] < moved[2] < moved[3]
