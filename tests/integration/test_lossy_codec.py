"""A lossy tier codec is held to its own tolerance against the no-cache reference."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from engine_helpers import close_to_reference, micro_cache_config, micro_model, reference_logits

from bench.codecs import LOSSY_TOLERANCE
from engine.engine import Engine


def test_fp16_tier_codec_stays_within_its_tolerance_and_lossless_zstd_is_exact(tmp_path):
    model = micro_model(seed=1)
    prompt = np.random.default_rng(3).integers(0, 256, 45).tolist()
    ref = reference_logits(model, prompt)[-1]
    got = {}
    for codec, tol in (("fp16", LOSSY_TOLERANCE["fp16"]), ("zstd", 1e-4)):
        config = micro_cache_config(lmdb_dir=str(tmp_path / codec), codec=codec)
        with Engine(model, config) as writer:
            writer.prefill_logits(prompt)
        with Engine(model, config) as reader:  # an empty pool: the prefix comes from LMDB
            logits, cached = reader.prefill_logits(prompt)
        assert cached == 44
        assert close_to_reference(logits, ref, tol)
        got[codec] = logits
    # the downcast is real: the fp16 prefix moves the logits where the lossless one does not
    assert float((got["fp16"] - got["zstd"]).abs().max()) > 1e-5
