"""`kvstore demo`: every request matches the no-cache reference, with the expected hits."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from engine.cli import main
from engine.demo import print_demo_table
from kvstore.config import CacheConfig


@pytest.mark.slow
def test_demo_outputs_equal_the_no_cache_reference_and_pass_2_hits_lmdb(capsys, tmp_path) -> None:
    argv = ["demo", "--model", "tiny", "--json", "--max-tokens", "4", "--lmdb-dir",
            str(tmp_path), "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert err.splitlines()[0] == (
        "kvstore demo: tiny model (random weights: its text is noise; what counts is cached "
        "output = uncached output) on CPU, tiers device + lmdb: 12 requests, each checked "
        "against a no-cache run"
    )
    assert "requests: 100%" in err and "12/12" in err  # the progress bar, on stderr
    rows = report["requests"]
    assert report["all_identical"] is True
    assert [r["name"] for r in rows] == [
        *(f"chat turn {i}" for i in range(1, 5)),
        *(f"question {i}" for i in range(1, 5)),
        *(f"pass 2, question {i}" for i in range(1, 5)),
    ]
    assert rows[0]["cached_tokens"] == 0
    for prev, row in itertools.pairwise(rows[:4]):
        # the template renders the history again, the answer included: turn k+1 hits turn
        # k's prompt and all its generated tokens but the last, in whole blocks of 16 from
        # the index; the rest comes from turn k's kept partial block as far as the rendered
        # answer repeats the generated tokens (the byte model's noise may not survive being
        # decoded and encoded again: SmolLM2's test checks that every token comes back)
        whole = (prev["prompt_tokens"] + 4 - 1) // 16 * 16
        assert whole <= row["cached_tokens"] <= prev["prompt_tokens"] + 4 - 1
    # the questions share the system prompt with the chat (1024 tokens of the byte model)
    assert all(r["cached_tokens"] >= 992 for r in rows[4:8])
    # pass 2: a fresh device pool; each prompt's whole blocks come back, the first from LMDB
    # alone, the rest from blocks pass 2 already promoted plus LMDB
    pass2 = rows[8:]
    assert [r["cached_tokens"] for r in pass2] == [
        (r["prompt_tokens"] - 1) // 16 * 16 for r in pass2
    ]
    assert pass2[0]["cached_by_tier"] == {"lmdb": pass2[0]["cached_tokens"]}
    assert all(r["cached_by_tier"]["lmdb"] >= 32 for r in pass2)


def test_the_demo_table_prints_the_chat_and_explains_its_figures(capsys) -> None:
    row = {"name": "chat turn 1", "question": "Hi?", "answer": "Hello.", "prompt_tokens": 40,
           "cached_tokens": 0, "cached_by_tier": {}, "ttft_s": 0.01, "ttft_nocache_s": 0.009,
           "identical": True}  # fmt: skip
    hit = {**row, "name": "question 1", "cached_tokens": 32, "cached_by_tier": {"device": 32},
           "ttft_nocache_s": 0.02}  # fmt: skip
    report = {"requests": [row, hit], "all_identical": True, "runtime_s": 1.0}
    print_demo_table(report, "tiny", CacheConfig(redis_url="redis://x:1/0"), torch.device("cpu"))
    out = capsys.readouterr().out
    assert "user: Hi?" in out and "assistant: Hello." in out
    assert "kvstore demo: tiny model (random weights" in out and "CPU, device + redis" in out
    assert "2.0x" in out and "0.9x" not in out  # nothing cached: no speed-up shown
    assert "A first turn has nothing cached" in out
    assert "all identical: True  runtime 1.0 s" in out
