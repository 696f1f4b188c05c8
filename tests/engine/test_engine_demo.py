"""`kvstore demo`: every request matches the no-cache reference, with the expected hits."""

from __future__ import annotations

import itertools
import json

import pytest

from engine.cli import main


@pytest.mark.slow
def test_demo_outputs_equal_the_no_cache_reference_and_pass_2_hits_lmdb(capsys, tmp_path) -> None:
    assert main(["demo", "--json", "--max-tokens", "4", "--lmdb-dir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["requests"]
    assert report["all_identical"] is True
    assert [r["name"] for r in rows] == [
        *(f"chat turn {i}" for i in range(1, 5)),
        *(f"batch {i}" for i in range(1, 9)),
        *(f"pass 2, batch {i}" for i in range(1, 9)),
    ]
    assert rows[0]["cached_tokens"] == 0
    for prev, row in itertools.pairwise(rows[:4]):
        # turn k+1 hits turn k's prompt and all its generated tokens but the last (block 16)
        assert row["cached_tokens"] == (prev["prompt_tokens"] + 4 - 1) // 16 * 16
    # the batch shares the system prompt with the chat; batch 1 computes the "Question " block
    # while the other 7 wait for it (they arrive together), then hit it
    assert [r["cached_tokens"] for r in rows[4:12]] == [1008] + [1024] * 7
    # pass 2: a fresh device pool; each prompt's whole blocks come back (a prompt of exactly
    # 70 blocks is a whole-prompt hit), the first from LMDB alone, the rest from blocks pass 2
    # already promoted plus LMDB
    pass2 = rows[12:]
    assert [r["cached_tokens"] for r in pass2] == [r["prompt_tokens"] // 16 * 16 for r in pass2]
    assert pass2[0]["cached_by_tier"] == {"lmdb": pass2[0]["cached_tokens"]}
    assert all(r["cached_by_tier"]["lmdb"] >= 80 for r in pass2)
