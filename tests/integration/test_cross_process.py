"""Two processes share a tier: B, with an empty device pool, hits what A stored."""

import json
import os
import subprocess
from pathlib import Path

PROMPT_IDS = ",".join(str((i * 7) % 250) for i in range(61))  # 61 tokens: 15 whole blocks of 4


def generate(model_dir: Path, *flags: str, secret: str | None = None) -> dict:
    return run_generate(model_dir, *flags, secret=secret)[0]


def run_generate(model_dir: Path, *flags: str, secret: str | None = None) -> tuple[dict, str]:
    """`kvstore generate --json`'s output and its stderr."""
    cmd = [
        "kvstore",
        "generate",
        "--model",
        str(model_dir),
        "--prompt-ids",
        PROMPT_IDS,
        "--max-tokens",
        "8",
        "--block-size",
        "4",
        "--json",
        *flags,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    if secret is not None:
        env["KVSTORE_SECRET"] = secret
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


def check_b_hits_a(model_dir: Path, *flags: str) -> None:
    a = generate(model_dir, *flags)
    b = generate(model_dir, *flags)
    assert a["cached_tokens"] == 0
    assert b["cached_tokens"] == 60  # all 15 whole blocks: 60 < 61, the last token is computed
    assert b["output_token_ids"] == a["output_token_ids"]


def test_redis_is_shared_between_processes(model_dir, redis_server):
    check_b_hits_a(model_dir, "--redis-url", redis_server.url)


def test_redis_cluster_is_shared_between_processes(model_dir, redis_cluster):
    check_b_hits_a(model_dir, "--redis-url", redis_cluster.url)


def test_redis_over_tls_is_shared_between_processes(model_dir, redis_tls):
    check_b_hits_a(model_dir, "--redis-url", redis_tls.url)


def test_lmdb_dir_is_shared_between_processes(model_dir, tmp_path):
    check_b_hits_a(model_dir, "--lmdb-dir", str(tmp_path / "lmdb"))


def test_processes_with_two_secrets_keep_each_others_entries(model_dir, redis_server, tmp_path):
    """One process with a wrong secret must not empty the shared tiers: it reads the
    entries as foreign misses, keeps them, says why; the right secret still hits them."""
    flags = ("--redis-url", redis_server.url, "--lmdb-dir", str(tmp_path / "lmdb"))
    a = generate(model_dir, *flags, secret="right")
    entries = redis_server.client().dbsize()
    assert entries == 17  # a block per 4 of the 68 tokens with KV (61 prompt + 8 new - 1)
    wrong, stderr = run_generate(model_dir, *flags, secret="wrong")
    assert wrong["cached_tokens"] == 0
    assert "secret (KVSTORE_SECRET) differs" in stderr
    assert redis_server.client().dbsize() == entries  # 0 deleted
    again = generate(model_dir, *flags, secret="right")
    assert again["cached_tokens"] == 60  # from LMDB, which also kept them
    assert again["output_token_ids"] == wrong["output_token_ids"] == a["output_token_ids"]
