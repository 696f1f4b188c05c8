"""`python -m bench ttft` plumbing on a short prompt (no timing asserts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.ttft import main
from bench.ttft.point import round_order


def test_ttft_bench_reports_every_point_with_the_cached_prefix(capsys, tmp_path: Path) -> None:
    argv = ["--tier", "device,lmdb", "--lmdb-dir", str(tmp_path), "--prompt-tokens", "64",
            "--cached", "32,48", "--runs", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert [(p["tier"], p["prompt_tokens"], p["cached_tokens"]) for p in points] == [
        ("device", 64, 32),
        ("device", 64, 48),
        ("lmdb", 64, 32),
        ("lmdb", 64, 48),
    ]
    assert all(p["same_first_token"] for p in points)
    keys = {"ttft_nocache_s", "ttft_ideal_s", "ttft_kvstore_s", "ratio_to_ideal"}
    assert all(keys <= set(p) for p in points)
    for p in points[2:]:  # one round: its kvstore time over the device hit timed beside it
        assert p["ratio_to_device"] == p["ttft_kvstore_s"] / p["ttft_device_s"]
    assert [p["ratio_to_device"] for p in points[:2]] == [1.0, 1.0]


def test_a_spill_tier_point_times_the_device_hit_in_its_own_rounds(capsys, tmp_path) -> None:
    """No device tier asked for: each round of the lmdb point still times a device-tier hit
    of the same prompt beside the tier's, and pairs them round by round."""
    argv = ["--tier", "lmdb", "--lmdb-dir", str(tmp_path), "--prompt-tokens", "64",
            "--cached", "48", "--runs", "3", "--json"]  # fmt: skip
    assert main(argv) == 0
    (point,) = json.loads(capsys.readouterr().out)["points"]
    assert point["ttft_device_s"] > 0 and point["ratio_to_device"] > 0
    assert point["same_first_token"]


def test_round_order_pairs_kvstore_with_ideal_and_device_on_either_side() -> None:
    """kvstore runs first in the even rounds (it leaves the prefix in the pool for device,
    after ideal) and last in the odd ones (device then finds it from the round before)."""
    orders = [round_order(r, device=True) for r in range(4)]
    assert orders == [
        ["nocache", "kvstore", "ideal", "device"],
        ["nocache", "device", "ideal", "kvstore"],
        ["kvstore", "ideal", "device", "nocache"],
        ["device", "ideal", "kvstore", "nocache"],
    ]
    assert [round_order(r) for r in range(2)] == [
        ["nocache", "ideal", "kvstore"],
        ["nocache", "kvstore", "ideal"],
    ]


def test_ttft_bench_rejects_a_point_off_the_block_grid(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--cached", "100"])
    assert "multiple of --block-size" in capsys.readouterr().err


def test_ttft_bench_behind_a_throttled_redis_reports_what_the_gate_measured(
    capsys, redis_server
) -> None:
    argv = ["--tier", "redis", "--redis-url", redis_server.url, "--throttle-mbps", "50",
            "--prompt-tokens", "64", "--cached", "48", "--runs", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    (point,) = json.loads(capsys.readouterr().out)["points"]
    gate = point["read_gate"]
    assert gate["enabled"] and gate["prefill_tokens_per_s"] is not None  # the 64-token warm-up
    assert set(gate["bandwidth_bytes_per_s"]) == {"redis"}  # its first read measured it
    assert point["read_skipped"] in (0, 1) and point["loaded_tokens"] in (0, 48)
    assert point["ratio_to_nocache"] > 0


def test_ttft_bench_throttles_only_a_redis_it_is_given(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--tier", "device", "--throttle-mbps", "20"])
    assert "--throttle-mbps: give a positive rate, and --redis-url" in capsys.readouterr().err


def test_ttft_bench_runs_each_spill_tier_under_each_codec(capsys, tmp_path) -> None:
    argv = ["--tier", "device,lmdb", "--codec", "none,int8", "--lmdb-dir", str(tmp_path),
            "--prompt-tokens", "64", "--cached", "48", "--runs", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert [(p["tier"], p["codec"], p["cached_tokens"]) for p in points] == [
        ("device", "none", 48),
        ("lmdb", "none", 48),
        ("lmdb", "int8", 48),
    ]
    assert points[1]["same_first_token"]  # lossless: the no-cache token


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--codec", "int4"], "unknown codec 'int4'"),
        (["--tier", "memory:layers", "--codec", "int8"], "codec none only"),
    ],
)
def test_ttft_bench_refuses_a_codec_it_cannot_run(capsys, argv, why) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert why in capsys.readouterr().err


def test_ttft_bench_on_a_quantized_pool_moves_its_blocks_as_they_are(capsys, tmp_path) -> None:
    argv = ["--tier", "device,lmdb", "--kv-cache-dtype", "int8", "--lmdb-dir", str(tmp_path),
            "--prompt-tokens", "64", "--cached", "48", "--runs", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert [(p["tier"], p["cached_tokens"], p["read_skipped"]) for p in points] == [
        ("device", 48, 0),
        ("lmdb", 48, 0),
    ]
