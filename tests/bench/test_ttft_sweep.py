"""`python -m bench ttft --sweep` at a tiny scale: every point's fields, both peers, the plot."""

from __future__ import annotations

import json

import pytest

from bench.ttft import main
from engine.model.loading import load_model


def test_sweep_reports_every_tier_with_both_peers_and_writes_the_plot(tmp_path, capsys) -> None:
    argv = ["--sweep", "--lengths", "64", "--fractions", "0.5", "--tier", "device,memory"]
    argv += ["--runs", "1", "--json", "--out", str(tmp_path)]
    assert main(argv, model=load_model("tiny")) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    # half of 64 tokens, in whole 16-token blocks: 32 cached tokens, one point per tier
    grid = [
        (p["tier"], p["prompt_tokens"], p["cached_fraction"], p["cached_tokens"]) for p in points
    ]
    assert grid == [("device", 64, 0.5, 32), ("memory", 64, 0.5, 32)]
    for p in points:
        assert p["same_first_token"] is True
        assert p["ratio_to_ideal"] == pytest.approx(p["ttft_kvstore_s"] / p["ttft_ideal_s"])
        assert p["ttft_hf_generate_s"] > 0
        assert "cb_error" not in p, p.get("cb_error")  # the peer runs with this transformers
        assert 0 < p["ttft_cb_first_token_s"] < p["ttft_cb_s"]
        # the probe took exactly the shared prefix from the seed's blocks, nothing more
        assert p["cb_prefix_matched_tokens"] == 32
    assert (tmp_path / "ttft_sweep.png").stat().st_size > 0


def test_sweep_rejects_a_fraction_that_caches_no_whole_block(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--sweep", "--lengths", "64", "--fractions", "0.1"])
    assert exit_.value.code == 2
    assert "fraction 0.1 of 64 tokens gives 0 cached tokens; need 0 < c < 64" in (
        capsys.readouterr().err
    )
