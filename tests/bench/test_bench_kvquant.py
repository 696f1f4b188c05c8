"""`python -m bench kvquant`: a quantized codec's cost against no cache; `none` the control."""

from __future__ import annotations

import json

from bench.kvquant import main


def test_the_control_codec_matches_no_cache_and_int8_moves_the_logits(capsys) -> None:
    argv = ["--model", "tiny", "--codecs", "none,int8", "--chunk", "1024", "--prompts", "2",
            "--max-tokens", "4", "--kv-cache-dtypes", "", "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    none, int8 = report["results"]
    # tiny's byte tokenizer: 3167 tokens; chunks start at 1024, 2048, 3072, each scoring the
    # tokens after its first up to the text's last: 3166 - 1024
    assert report["text_tokens"] == 3167
    assert none["scored_tokens"] == int8["scored_tokens"] == 3166 - 1024
    assert none["ppl"] == none["ppl_nocache"] or abs(none["ppl_change"]) < 1e-6
    assert none["max_logit_change"] < 1e-4  # the exact contract
    assert (none["identical"], none["prompts"], none["divergences"]) == (2, 2, [])
    assert none["meet_contract"] == 2
    assert int8["max_logit_change"] > 1e-2  # quantized: bounded, not exact
    assert int8["ppl"] != int8["ppl_nocache"]
    # each prompt's whole blocks came from the tier (a whole-prompt hit recomputes only the
    # last token's logits)
    cached = sum(n // 16 * 16 for n in report["prompt_tokens"])
    assert none["tier_cached_tokens"] == int8["tier_cached_tokens"] == cached
    ties = report["reference_ties"]
    assert len(ties) == 2 and all(0 <= t["token"] < 4 and t["top2_gap"] >= 0 for t in ties)
    for d in int8["divergences"]:  # a token changed where no cache came at least that close
        assert 0 <= d["token"] < 4 and d["top2_gap"] >= ties[d["prompt"]]["top2_gap"] - 1e-4


def test_the_closest_tie_is_the_smallest_gap_of_the_continuations_own_forwards() -> None:
    from bench.kvquant import closest_tie, continuation_gaps, top2_gaps
    from engine.loop.sequential import reference_generate
    from engine.model.loading import load_model

    lm = load_model("tiny")
    prompt = list(range(40, 90))
    ref, _ = reference_generate(lm, prompt, 6)
    # one forward per greedy token, each after the prompt and the tokens before it
    gaps = [top2_gaps(lm, prompt + ref[:j], len(prompt) + j - 1)[0] for j in range(len(ref))]
    tie = closest_tie(continuation_gaps(lm, prompt, ref)[:-1])
    assert len(ref) == 6 and tie["token"] == gaps.index(min(gaps))
    assert abs(tie["top2_gap"] - min(gaps)) < 1e-4


def test_a_quantized_pools_hits_read_what_its_misses_read(capsys) -> None:
    argv = ["--model", "tiny", "--codecs", "", "--kv-cache-dtypes", "auto,int8", "--prompts",
            "2", "--max-tokens", "4", "--json"]  # fmt: skip
    assert main(argv) == 0
    auto, int8 = json.loads(capsys.readouterr().out)["pools"]
    assert (auto["ppl_change"], auto["max_logit_change"], auto["identical_to_auto"]) == (0, 0, 2)
    assert int8["hit_equals_miss"] == auto["hit_equals_miss"] == 2
    assert int8["max_logit_change"] > 1e-2 and int8["ppl"] != auto["ppl"]
    # tiny's block: 8 layers x (K, V) x 2 heads x 16 tokens x 64 values, 4 bytes each
    # (131072) or 1 byte and a 2-byte scale per 64 (33792): 8192 and 31775 blocks in 1 GiB
    assert (auto["blocks"], int8["blocks"]) == (8192, 31775)


def test_bad_arguments_are_refused_with_what_to_fix(capsys) -> None:
    for argv, why in ((["--codecs", "int4"], "unknown codec 'int4'"),
                      (["--kv-cache-dtypes", "int4"], "unknown 'int4'"),
                      (["--chunk", "10"], "multiple of the block size")):  # fmt: skip
        try:
            main(argv)
        except SystemExit as e:
            assert e.code == 2
        assert why in capsys.readouterr().err
