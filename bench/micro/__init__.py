"""Micro benchmark of the radix index: hash + match and hash + insert cost per block, and index
memory per cached block, with the index pre-filled to 10^4, 10^5 and 10^6 cached blocks.

A query is a 2048-token prompt in 16-token blocks (128 blocks). The index is filled with
distinct random prompts in groups that share a system-prompt prefix (32 blocks shared by 8
prompts), so the tree has realistic branching. Memory is what tracemalloc sees allocated by
the fill and still alive afterwards (token ids, keys, block ids, nodes, policy state).

    python -m bench micro [--json] [--sizes 10000,100000,1000000] [--policy lru]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import tracemalloc

import numpy as np
from tqdm import tqdm

from hashing import BlockHasher, Namespace
from kvstore.config import POLICY_NAMES
from kvstore.index import RadixIndex
from kvstore.index.policies import make_policy
from kvstore.index.policies.retaining import RetainingPolicy

BLOCK_SIZE = 16
PROMPT_TOKENS = 2048
PROMPT_BLOCKS = PROMPT_TOKENS // BLOCK_SIZE
SYSTEM_TOKENS = 512  # shared by every prompt of a group
GROUP_PROMPTS = 8
VOCAB = 128_000
MATCH_REPEATS = 300
INSERT_REPEATS = 100
TARGETS = {"us_per_block": 1.5, "us_per_block_insert": 3.0, "bytes_per_block": 512, "growth": 1.5}


def _namespace() -> Namespace:
    return Namespace("bench-micro", "float16", 32, 8, 128, BLOCK_SIZE)


class _Filler:
    """Inserts random prompts with fresh block ids, GROUP_PROMPTS per system prompt."""

    def __init__(self, index: RadixIndex, hasher: BlockHasher, seed: int):
        self.index, self.hasher = index, hasher
        self.rng = np.random.default_rng(seed)
        self.next_block_id = 0
        self.system = self._tokens(SYSTEM_TOKENS)
        self.left_in_group = GROUP_PROMPTS

    def _tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB, n, dtype=np.uint32)

    def new_prompt(self, system: np.ndarray | None = None) -> np.ndarray:
        if system is None:
            if self.left_in_group == 0:
                self.system, self.left_in_group = self._tokens(SYSTEM_TOKENS), GROUP_PROMPTS
            self.left_in_group -= 1
            system = self.system
        return np.concatenate([system, self._tokens(PROMPT_TOKENS - len(system))])

    def fresh_ids(self) -> range:
        self.next_block_id += PROMPT_BLOCKS
        return range(self.next_block_id - PROMPT_BLOCKS, self.next_block_id)

    def fill(self, target_blocks: int) -> None:
        with tqdm(total=target_blocks, desc=f"fill {target_blocks:.0e}", unit="blk") as bar:
            while self.index.num_cached_blocks < target_blocks:
                before = self.index.num_cached_blocks
                prompt = self.new_prompt()
                self.index.insert(self.hasher.hash_blocks(prompt), prompt, self.fresh_ids())
                bar.update(min(self.index.num_cached_blocks, target_blocks) - before)


def _random_cached_prompt(index: RadixIndex, rng: np.random.Generator) -> np.ndarray:
    node = index.root
    while node.children:
        children = list(node.children.values())
        node = children[rng.integers(len(children))]
    return index.path_token_ids(node)


def _median_us_per_block(samples_ns: list[int]) -> float:
    return statistics.median(samples_ns) / 1000 / PROMPT_BLOCKS


class _Bench:
    """One pre-filled index and its query prompts."""

    def __init__(self, target_blocks: int, policy: str, seed: int):
        self.hasher = BlockHasher(_namespace())
        # as the cache builds it: the policy inside retention's wrapper
        self.index = RadixIndex(BLOCK_SIZE, RetainingPolicy(make_policy(policy), time.monotonic))
        self.filler = _Filler(self.index, self.hasher, seed)
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        self.filler.fill(target_blocks)
        self.fill_s = time.perf_counter() - t0
        gc.collect()
        self.index_bytes = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        self.cached_blocks, self.nodes = self.index.num_cached_blocks, self.index.num_nodes
        self.rng = np.random.default_rng(seed + 1)
        self.hits = [_random_cached_prompt(self.index, self.rng) for _ in range(64)]
        self.match_ns: list[int] = []
        self.hash_ns: list[int] = []
        self.insert_ns: list[int] = []

    def time_match(self, i: int) -> None:
        prompt = self.hits[i % len(self.hits)]
        t0 = time.perf_counter_ns()
        keys = self.hasher.hash_blocks(prompt)
        t1 = time.perf_counter_ns()
        result = self.index.match_prefix(keys, prompt)
        t2 = time.perf_counter_ns()
        if result.num_blocks != PROMPT_BLOCKS:
            raise RuntimeError(f"expected a full hit, matched {result.num_blocks} blocks")
        self.match_ns.append(t2 - t0)
        self.hash_ns.append(t1 - t0)

    def time_insert(self) -> None:
        """A new prompt sharing a cached system prompt; then evicts as many blocks (untimed),
        so the index keeps its size, as a full cache would."""
        system = _random_cached_prompt(self.index, self.rng)[:SYSTEM_TOKENS]
        prompt = self.filler.new_prompt(system)
        ids = self.filler.fresh_ids()
        before = self.index.num_cached_blocks
        t0 = time.perf_counter_ns()
        self.index.insert(self.hasher.hash_blocks(prompt), prompt, ids)
        self.insert_ns.append(time.perf_counter_ns() - t0)
        self.index.evict(self.index.num_cached_blocks - before)

    def result(self) -> dict:
        return {
            "cached_blocks": self.cached_blocks,
            "nodes": self.nodes,
            "fill_s": self.fill_s,
            "us_per_block": _median_us_per_block(self.match_ns),
            "hash_us_per_block": _median_us_per_block(self.hash_ns),
            "us_per_block_insert": _median_us_per_block(self.insert_ns),
            "bytes_per_block": self.index_bytes / self.cached_blocks,
        }


def measure(sizes: list[int], policy: str, seed: int = 0) -> dict[int, dict]:
    """Fill one index per size, then time them in interleaved rounds so that machine noise
    hits every size alike (the growth ratio compares them)."""
    benches = {n: _Bench(n, policy, seed) for n in sizes}
    for i in range(MATCH_REPEATS):
        for bench in benches.values():
            bench.time_match(i)
    for _ in range(INSERT_REPEATS):
        for bench in benches.values():
            bench.time_insert()
    return {n: bench.result() for n, bench in benches.items()}


def _report(results: dict[int, dict]) -> dict:
    sizes = sorted(results)
    out: dict = {
        key: {str(n): round(results[n][key], 4) for n in sizes}
        for key in ("us_per_block", "us_per_block_insert", "bytes_per_block", "hash_us_per_block")
    }
    out["growth_ratio"] = round(
        results[sizes[-1]]["us_per_block"] / results[sizes[0]]["us_per_block"], 4
    )
    return out


def _print_table(results: dict[int, dict], report: dict, policy: str) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"radix index ({policy}): us per block of a {PROMPT_BLOCKS}-block prompt; bytes per block"
    )
    table = Table(title=title)
    for col in ("blocks", "nodes", "fill s", "hash", "hash+match", "hash+insert", "bytes"):
        table.add_column(col, justify="right")
    for n in sorted(results):
        r = results[n]
        table.add_row(
            f"{r['cached_blocks']:,}",
            f"{r['nodes']:,}",
            f"{r['fill_s']:.1f}",
            f"{r['hash_us_per_block']:.3f}",
            f"{r['us_per_block']:.3f}",
            f"{r['us_per_block_insert']:.3f}",
            f"{r['bytes_per_block']:.0f}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"growth ratio (hash+match, largest / smallest): {report['growth_ratio']:.3f}   "
        f"targets: hash+match <= {TARGETS['us_per_block']} us/blk at 1e6, hash+insert <= "
        f"{TARGETS['us_per_block_insert']}, bytes <= {TARGETS['bytes_per_block']}, growth <= "
        f"{TARGETS['growth']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench micro",
        description="hash + match / insert cost per block and index bytes per block",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--sizes", default="10000,100000,1000000", help="cached blocks, comma list")
    parser.add_argument("--policy", default="lru", choices=POLICY_NAMES)
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        parser.error(f"--sizes must be a comma list of ints, got {args.sizes!r}")
    if not sizes or min(sizes) < PROMPT_BLOCKS:
        parser.error(f"--sizes must list sizes >= {PROMPT_BLOCKS}")
    results = measure(sizes, args.policy)
    report = _report(results)
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(results, report, args.policy)
    return 0
