"""The steps of `bench gpu` (bench/gpu/__init__.py): their commands, limits and parsers, on
a GPU or, with --smoke, the same steps on the CPU at toy sizes."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.launch import RedisServer

BIG, SMALL = "dummy:llama-3.1-8b", "dummy:llama-3.2-1b"
# the engine's tests that run on KVSTORE_TEST_DEVICE
GPU_TESTS = ("tests/engine/test_cuda.py", "tests/engine/test_async_scheduling.py",
             "tests/engine/test_paged_attention.py", "tests/engine/test_layer_loads.py",
             "tests/engine/test_engine_batching.py")  # fmt: skip


@dataclass(frozen=True)
class Step:
    name: str
    command: list[str]
    timeout_s: float
    parse: Callable[[str], object]
    env: dict[str, str] = field(default_factory=dict)


def last_json(out: str) -> dict | None:
    """The last line of `out` that is a JSON object."""
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def pytest_counts(out: str) -> dict:
    """pytest's summary as counts: {"passed": n, "failed": n, ...}."""
    return {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped)", out)}


def bench(*args: str) -> list[str]:
    return [sys.executable, "-m", "bench", *args]


def plan(args: argparse.Namespace, work: Path) -> tuple[list[Step], RedisServer | None]:
    """The steps, and the private redis-server the tier steps use (started here)."""
    redis = RedisServer(work / "redis", binary=args.redis_server).start()
    lmdb = str(work / "lmdb")
    steps = _smoke(redis.url, lmdb) if args.smoke else _gpu(redis.url, lmdb)
    return steps, redis


def _gpu(redis_url: str, lmdb: str) -> list[Step]:
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GPU_TESTS]
    return [
        Step("tests", tests, 100, pytest_counts, {"KVSTORE_TEST_DEVICE": "cuda"}),
        Step("ttft", bench("ttft", "--device", "cuda", "--model", BIG, "--tier",
                           "device,memory,lmdb,redis", "--redis-url", redis_url, "--lmdb-dir",
                           lmdb, "--runs", "5", "--threads", "8", "--json"), 90, last_json),
        Step("load", bench("load", "--device", "cuda", "--model", SMALL, "--levels", "1,8,32",
                           "--json"), 190, last_json),
        Step("e2e", bench("e2e", "--device", "cuda", "--model", BIG, "--workload",
                          "shared-prefix", "--repeats", "2", "--no-peer", "--json"), 60, last_json),
        Step("step", bench("step", "--device", "cuda", "--json"), 40, last_json),
        # last: what the budget leaves (int8 entries, dequantized on the host into staging)
        Step("codecs", bench("ttft", "--device", "cuda", "--model", BIG, "--tier",
                             "device,memory,lmdb,redis", "--codec", "int8", "--redis-url",
                             redis_url, "--lmdb-dir", lmdb, "--runs", "5", "--threads", "8",
                             "--json"), 90, last_json),
    ]  # fmt: skip


def _smoke(redis_url: str, lmdb: str) -> list[Step]:
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "tests/engine/test_decode_graphs.py", "-k", "buckets or fill"]  # fmt: skip
    return [
        Step("tests", tests, 60, pytest_counts, {"KVSTORE_TEST_DEVICE": "cpu"}),
        Step("ttft", bench("ttft", "--model", "tiny", "--tier", "device,memory,lmdb,redis",
                           "--redis-url", redis_url, "--lmdb-dir", lmdb, "--prompt-tokens",
                           "128", "--cached", "96", "--runs", "1", "--json"), 120, last_json),
        Step("load", bench("load", "--model", "tiny", "--levels", "1", "--sessions", "1",
                           "--turns", "1", "--max-tokens", "4", "--no-peer", "--json"),
             120, last_json),
        Step("e2e", bench("e2e", "--model", "tiny", "--workload", "shared-prefix",
                          "--repeats", "1", "--new-tokens", "2", "--no-peer", "--json"),
             120, last_json),
        Step("step", bench("step", "--batches", "1,2", "--rounds", "1", "--new-tokens", "4",
                           "--prompt-tokens", "8", "--json"), 120, last_json),
        Step("codecs", bench("ttft", "--model", "tiny", "--tier", "device,redis", "--codec",
                             "int8", "--redis-url", redis_url, "--prompt-tokens", "128",
                             "--cached", "96", "--runs", "1", "--json"), 120, last_json),
    ]  # fmt: skip
