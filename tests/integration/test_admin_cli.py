"""`kvstore stats` and `kvstore clear` against real LMDB and Redis, and what the commands
say when Redis cannot be reached."""

import json
import os
import socket

import pytest
from cli_helpers import kvstore

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
    assert stats["tiers"]["redis"] == {"entries": 6, "bytes": None, "capacity_bytes": None,
                                       "reachable": True, "error": None}  # fmt: skip
    ns = stats["namespace"]
    other = ["--namespace", "0123456789abcdef", "--block-size", "4", *tiers]
    elsewhere = run_json(capsys, "stats", "--json", *other)["tiers"]
    assert {t: s["entries"] for t, s in elsewhere.items()} == {"lmdb": 0, "redis": 0}
    assert run_json(capsys, "clear", "--json", *other)["removed"] == {"lmdb": 0, "redis": 0}
    removed = run_json(capsys, "clear", "--json", "--namespace", ns, "--block-size", "4", *tiers)
    assert removed == {"namespace": ns, "removed": {"lmdb": 6, "redis": 6}, "unreachable": {}}
    stats = run_json(capsys, "stats", "--json", "--namespace", ns, *tiers)
    assert {t: s["entries"] for t, s in stats["tiers"].items()} == {"lmdb": 0, "redis": 0}


def test_stats_without_a_shared_tier_is_a_clear_error(capsys):
    assert main(["stats", "--namespace", "0123456789abcdef"]) == 2
    assert "--lmdb-dir or --redis-url" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["stats", "clear"])
def test_a_tier_mistake_fails_before_any_model_loads(command, tmp_path):
    """No tier, or an LMDB directory that does not exist (nothing is created there): one
    line and exit 2 in well under a second's model load, without importing torch."""
    missing = tmp_path / "typo"
    for argv, error in (
        ([], "no shared tier configured"),
        (["--lmdb-dir", str(missing)], f"lmdb_dir: {missing} does not exist"),
    ):
        proc = kvstore(command, *argv)  # (the default model is smollm2: never loaded here)
        assert proc.returncode == 2 and error in proc.stderr, proc.stderr
    assert not missing.exists()


def test_stats_and_clear_offer_only_the_flags_they_read():
    from engine.cli import build_parser

    for name in ("stats", "clear"):
        sub = build_parser()._subparsers._group_actions[0].choices[name]
        flags = {o for a in sub._actions for o in a.option_strings}
        assert {"--lmdb-dir", "--redis-url", "--namespace", "--model", "--block-size"} <= flags
        assert not flags & {"--device-blocks", "--max-num-seqs", "--eviction-policy",
                            "--linear-kernel", "--cuda-graphs", "--tail-blocks"}  # fmt: skip


def test_a_malformed_namespace_is_a_clear_error(capsys, tmp_path):
    assert main(["clear", "--namespace", "xyz", "--lmdb-dir", str(tmp_path)]) == 2
    assert "16 hex digits" in capsys.readouterr().err


def closed_url() -> str:
    """A Redis URL on a loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def refused(url: str) -> str:
    port = url.rsplit(":", 1)[1].split("/")[0]
    return f"ConnectionError: Error 111 connecting to 127.0.0.1:{port}. Connection refused."


@pytest.mark.integration
def test_generate_with_redis_down_answers_and_says_so_on_stderr():
    url = closed_url()
    proc = kvstore("generate", "--model", "tiny", "--prompt-ids", PROMPT, "--max-tokens", "2",
                   "--ignore-eos", "--block-size", "4", "--json", "--redis-url", url,
                   "--breaker-failures", "1", "--breaker-cooldown-s", "3600")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["prompt_tokens"], out["cached_tokens"], len(out["output_token_ids"])) == (20, 0, 2)
    assert proc.stderr.splitlines() == [
        f"kvstore generate: warning: redis tier unreachable at start ({url}: {refused(url)}): "
        "lookups miss it and writes to it are dropped until it answers",
        "kvstore generate: warning: redis tier: circuit breaker open after 1 failure in a row "
        f"(last: {refused(url)}): lookups miss the tier and writes to it are dropped for "
        "3600 s, then one call probes it",
    ]


def test_stats_and_clear_say_which_tier_does_not_answer(capsys, tmp_path):
    url = closed_url()
    tiers = ["--namespace", "0123456789abcdef", "--lmdb-dir", str(tmp_path), "--redis-url", url]
    assert main(["stats", "--json", *tiers]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["tiers"] == {
        "lmdb": {"entries": 0, "bytes": os.sysconf("SC_PAGESIZE"), "capacity_bytes": 4 * 2**30,
                 "reachable": True, "error": None},
        "redis": {"entries": None, "bytes": None, "capacity_bytes": None, "reachable": False,
                  "error": f"{url}: {refused(url)}"},
    }  # fmt: skip
    assert main(["clear", "--json", *tiers]) == 1
    assert json.loads(capsys.readouterr().out) == {
        "namespace": "0123456789abcdef",
        "removed": {"lmdb": 0, "redis": None},
        "unreachable": {"redis": f"{url}: {refused(url)}"},
    }
