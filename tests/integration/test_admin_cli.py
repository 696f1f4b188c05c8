"""`kvstore stats` and `kvstore clear` against real LMDB and Redis."""

import json

from engine.cli import main

PROMPT = ",".join(str(i) for i in range(1, 21))  # 20 tokens; + 8 generated: KV for 27 = 6 blocks


def run_json(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_stats_counts_entries_and_clear_empties_only_that_namespace(
    capsys, model_dir, tmp_path, redis_server
):
    tiers = ["--lmdb-dir", str(tmp_path / "lmdb"), "--redis-url", redis_server.url]
    common = ["--model", str(model_dir), "--block-size", "4", *tiers]
    run_json(capsys, "generate", "--prompt-ids", PROMPT, "--max-tokens", "8", "--json", *common)
    stats = run_json(capsys, "stats", "--json", *common)
    assert {t: s["entries"] for t, s in stats["tiers"].items()} == {"lmdb": 6, "redis": 6}
    ns = stats["namespace"]
    other = ["--namespace", "0123456789abcdef", "--block-size", "4", *tiers]
    assert run_json(capsys, "clear", "--json", *other)["removed"] == {"lmdb": 0, "redis": 0}
    removed = run_json(capsys, "clear", "--json", "--namespace", ns, "--block-size", "4", *tiers)
    assert removed == {"namespace": ns, "removed": {"lmdb": 6, "redis": 6}}
    stats = run_json(capsys, "stats", "--json", "--namespace", ns, *tiers)
    assert {t: s["entries"] for t, s in stats["tiers"].items()} == {"lmdb": 0, "redis": 0}


def test_stats_without_a_shared_tier_is_a_clear_error(capsys):
    assert main(["stats", "--namespace", "0123456789abcdef"]) == 2
    assert "--lmdb-dir or --redis-url" in capsys.readouterr().err


def test_a_malformed_namespace_is_a_clear_error(capsys, tmp_path):
    assert main(["clear", "--namespace", "xyz", "--lmdb-dir", str(tmp_path)]) == 2
    assert "16 hex digits" in capsys.readouterr().err
