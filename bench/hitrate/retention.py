"""`bench hitrate --retain-s T`: what a retention rule buys and costs on a trace.

The rule is "each request retains its prompt's cacheable blocks for T seconds" (what an
agent that puts a cache breakpoint on every request asks for). The trace is replayed through
a real `PrefixCache` (device tier, CPU pool, LRU, one token a block as in
`bench.hitrate.live`) whose clock is the trace's: before request r the clock reads r's
arrival time, so a TTL ends where the trace says T seconds have passed. Per request: `lookup`
the cacheable blocks, `store` them, `release`, then `retain` them for T. The same replay
without `retain` is plain LRU at the same capacity.

Reported per capacity: both block and token hit rates; the block hits retention won (a
request hit more than under LRU) and lost (less: the retained blocks crowded out others), per
request; and the cost in capacity, the device blocks retained after each request as a
fraction of the capacity, mean and peak. Retained blocks are capped at
`retention_max_fraction` of the pool (`--retain-max-fraction`, the cache's default unless
given): past it a request's blocks stay ordinary LRU blocks.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from bench.hitrate.live import serve
from bench.hitrate.output import print_rows, summary
from bench.traces import BlockTrace, TraceError
from hashing import Namespace
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig

__all__ = ["RetentionReplay", "add_arguments", "check_clock", "main", "retention_replay", "run"]

NAMESPACE = Namespace("bench-retain", "float32", 1, 1, 1, 1)


class RetentionReplay(NamedTuple):
    hits: list[int]  # device block hits per request
    retained: list[int]  # device blocks retained after each request


class TraceClock:
    """The replay's clock: the arrival time of the request being served, in seconds."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def check_clock(trace: BlockTrace) -> None:
    """A TraceError unless the trace's timestamps can serve as a clock: not all equal (a
    trace without arrival times) and never decreasing."""
    times = trace.timestamps
    if trace.num_requests > 1 and np.all(times == times[0]):
        raise TraceError(
            f"{trace.name}: every request has the same timestamp (no arrival times): "
            "--retain-s needs a trace whose timestamps are its requests' arrivals in ms"
        )
    back = np.flatnonzero(np.diff(times) < 0)
    if len(back):
        raise TraceError(
            f"{trace.name}: request {back[0] + 1} arrives before request {back[0]}: "
            "--retain-s replays in trace order and needs timestamps that never decrease"
        )


def retention_replay(
    trace: BlockTrace, capacity: int, retain_s: float | None, max_fraction: float | None = None
) -> RetentionReplay:
    """Per-request device hits of a `PrefixCache` of `capacity` blocks on the trace's clock;
    each request retains its cacheable blocks for `retain_s` (None: plain LRU)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    clock = TraceClock()
    cache = _cache(capacity, max_fraction, clock)
    offsets, times = trace.offsets.tolist(), (trace.timestamps / 1000.0).tolist()
    out = RetentionReplay([], [])
    try:
        for r in range(trace.num_requests):
            clock.now_s = times[r]
            tokens = trace.blocks[offsets[r] : offsets[r + 1]].astype(np.uint32)
            out.hits.append(serve(cache, tokens, len(tokens)))
            if retain_s is not None and len(tokens):
                cache.retain(tokens, retain_s)
            out.retained.append(retained_blocks(cache))
    finally:
        cache.close()
    return out


def _cache(capacity: int, max_fraction: float | None, clock: TraceClock) -> PrefixCache:
    cap = {} if max_fraction is None else {"retention_max_fraction": max_fraction}
    config = CacheConfig(block_size=1, device_blocks=capacity, **cap)
    return PrefixCache(config, NAMESPACE, clock=clock)


def retained_blocks(cache: PrefixCache) -> int:
    """Device blocks retained now (every tenant's)."""
    return sum(cache.stats()["retention"]["blocks_by_tenant"].values())


def _rate(n: float, of: float) -> float:
    return round(n / of, 6) if of else 0.0


def compare(
    trace: BlockTrace, capacity: int, lru: RetentionReplay, kept: RetentionReplay
) -> dict[str, Any]:
    """One capacity's report row: LRU against the retention rule."""
    refs, tokens, bt = trace.num_refs, int(trace.num_tokens.sum()), trace.block_tokens
    diff = np.asarray(kept.hits) - np.asarray(lru.hits)
    lru_hits, kept_hits = sum(lru.hits), sum(kept.hits)
    return {
        "capacity_blocks": capacity,
        "lru_block_hit_rate": _rate(lru_hits, refs),
        "retain_block_hit_rate": _rate(kept_hits, refs),
        "lru_token_hit_rate": _rate(lru_hits * bt, tokens),
        "retain_token_hit_rate": _rate(kept_hits * bt, tokens),
        "block_hits_won": int(diff[diff > 0].sum()),
        "block_hits_lost": int(-diff[diff < 0].sum()),
        "retained_mean_fraction": _rate(float(np.mean(kept.retained or [0])), capacity),
        "retained_peak_fraction": _rate(max(kept.retained, default=0), capacity),
    }


def run(
    trace: BlockTrace,
    capacities: Sequence[int],
    retain_s: float,
    max_fraction: float | None = None,
) -> dict[str, Any]:
    """The retention report: the trace, the rule, and a row per capacity."""
    from bench.hitrate import trace_summary

    check_clock(trace)
    rows = []
    for capacity in capacities:
        lru = retention_replay(trace, capacity, None, max_fraction)
        kept = retention_replay(trace, capacity, retain_s, max_fraction)
        rows.append(compare(trace, capacity, lru, kept))
    cap = CacheConfig().retention_max_fraction if max_fraction is None else max_fraction
    rule = {"retain_s": retain_s, "retention_max_fraction": cap}
    return {**trace_summary(trace), **rule, "results": rows}


COLUMNS = (
    "capacity",
    "LRU block hit",
    "retain block hit",
    "LRU token hit",
    "retain token hit",
    "won",
    "lost",
    "retained mean",
    "retained peak",
)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def rows(report: dict[str, Any]) -> list[list[str]]:
    unique = report["unique_blocks"]
    return [
        [
            f"{r['capacity_blocks']:,} ({_pct(r['capacity_blocks'] / unique if unique else 0)})",
            *(_pct(r[k]) for k in ("lru_block_hit_rate", "retain_block_hit_rate")),
            *(_pct(r[k]) for k in ("lru_token_hit_rate", "retain_token_hit_rate")),
            f"{r['block_hits_won']:,}",
            f"{r['block_hits_lost']:,}",
            *(_pct(r[k]) for k in ("retained_mean_fraction", "retained_peak_fraction")),
        ]
        for r in report["results"]
    ]


def title(report: dict[str, Any]) -> str:
    rule = (
        f"each request retains its prompt for {report['retain_s']:g} s of trace time "
        f"(retained at most {_pct(report['retention_max_fraction'])} of the capacity)"
    )
    return f"{summary(report)}; {rule}"


def print_table(report: dict[str, Any]) -> None:
    print_rows(title(report), COLUMNS, rows(report))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("a retention rule against LRU")
    group.add_argument(
        "--retain-s",
        type=float,
        metavar="T",
        help="each request retains its prompt's cacheable blocks for T seconds of the "
        "trace's time (its timestamps); reports hit rates against LRU at each capacity",
    )
    group.add_argument(
        "--retain-max-fraction",
        type=float,
        metavar="F",
        help="with --retain-s: the most of the capacity retained at once "
        "(default: the cache's retention_max_fraction)",
    )


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`bench hitrate --retain-s T`: a bad flag or trace exits with a one-line parser error."""
    from bench.hitrate import parse_workload

    if args.retain_s is None:
        parser.error("--retain-max-fraction needs --retain-s")
    if args.policy not in (None, "lru"):
        parser.error("--retain-s replays the cache's LRU: leave out --policy or give lru")
    if args.out is not None:
        parser.error("--retain-s prints its report (--json for JSON); --out is not for it")
    if args.capacity_blocks is None:
        parser.error("the following arguments are required: --capacity-blocks")
    trace, capacities = parse_workload(parser, args)
    try:
        if not args.retain_s > 0:
            raise ValueError(f"--retain-s must be a number of seconds > 0, got {args.retain_s}")
        report = run(trace, capacities, args.retain_s, args.retain_max_fraction)
    except ValueError as exc:  # TraceError too, and the cache's refusal of a bad fraction
        parser.error(str(exc))
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0
