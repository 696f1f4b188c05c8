"""Hit rate of each eviction policy on a workload or trace, against two offline figures.

    python -m bench hitrate --workload {shared-prefix,multiturn,rag,conversation,trace:PATH}
        --capacity-blocks N[,N...] --policy lru[,lfu,...]|all [--json] [--out DIR]

Capacities are blocks, or percentages of the trace's unique blocks ("1%,3%,10%").

The replay drives the real `RadixIndex` with the real policies, one block a unit: a block's
16-byte key is its dense id, and its one "token" is that id too (block_size=1), so matching
compares ids exactly as it compares token ids. Per request: match the longest cached prefix
(its blocks are the hits), lock that path, evict as many blocks as the request's uncached
blocks need beyond the free ones (the policy chooses), insert them (as many as fit), unlock.
Token hits are block hits times the trace's tokens per block.

Each capacity also gets the offline figures of `bench.hitrate.offline`:
`optimal_block_hit_rate` (a true upper bound for any prefix cache of that capacity) and
`offline_block_hit_rate` (Belady on the radix tree's leaves, an achievable reference), and each
policy its ratio to both.

`--tiers`, `--replicas`, `--route`, `--write-policy`, the routing and the cost flags plan
capacity instead: tier hierarchies and replica fleets (`bench.hitrate.plan`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from bench.hitrate.offline import infinite_hits, offline_leaf_hits, upper_bound_hits
from bench.hitrate.plan_output import write_report
from bench.hitrate.tiers import KEY_BYTES, key_blob
from bench.traces import BlockTrace, TraceError, from_token_requests, load_trace
from bench.workloads import WORKLOADS, WorkloadError, make_workload, parse_params
from engine.extras import require
from kvstore.index import RadixIndex
from kvstore.policies import POLICIES, make_policy
from kvstore.policies.base import Policy

__all__ = ["ReplayResult", "main", "parse_capacities", "replay", "run", "trace_summary"]

Progress = Callable[[int], None]
OnRequest = Callable[[int, int, RadixIndex], None]


class ReplayResult(NamedTuple):
    block_hits: int
    token_hits: int


def replay(
    trace: BlockTrace,
    policy: str | Policy,
    capacity: int,
    progress: Progress | None = None,
    on_request: OnRequest | None = None,
) -> ReplayResult:
    """Replay `trace` on a RadixIndex of `capacity` blocks evicting by `policy` (a name, or a
    fresh instance that only this replay uses).

    `on_request(r, hit_blocks, index)` runs after request r (tests check the index there).
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    if trace.num_unique >= 2**32:
        raise ValueError("more than 2^32 unique blocks do not fit the uint32 token ids")
    if not isinstance(policy, str) and policy.entries():
        raise ValueError("replay needs a fresh policy instance; this one already has entries")
    index = RadixIndex(1, make_policy(policy, capacity) if isinstance(policy, str) else policy)
    blob = key_blob(trace.num_unique)
    tokens = trace.blocks.astype(np.uint32)
    blocks, offsets = trace.blocks.tolist(), trace.offsets.tolist()
    block_hits = 0
    for r in range(trace.num_requests):
        lo, hi = offsets[r], offsets[r + 1]
        ids = blocks[lo:hi]
        keys = [blob[b * KEY_BYTES : (b + 1) * KEY_BYTES] for b in ids]
        hit = _serve(index, capacity, keys, tokens[lo:hi], ids)
        block_hits += hit
        if on_request is not None:
            on_request(r, hit, index)
        if progress is not None and r & 0x3FF == 0:
            progress(lo)
    return ReplayResult(block_hits, block_hits * trace.block_tokens)


def _serve(
    index: RadixIndex, capacity: int, keys: list[bytes], tokens: np.ndarray, ids: list[int]
) -> int:
    """One request: match, lock the hit path, make room, insert what fits, unlock."""
    n = len(ids)
    if n == 0:
        return 0
    match = index.match_prefix(keys, tokens)
    hit, node = match.num_blocks, match.last_node
    locked = node is not index.root
    if locked:
        index.lock(node)
    need = n - hit - (capacity - index.num_cached_blocks)
    if need > 0:
        index.evict(need)
    fit = hit + min(n - hit, capacity - index.num_cached_blocks)
    if fit > hit:
        index.insert(keys[:fit], tokens[:fit], ids[:fit])
    if locked:
        index.unlock(node)
    return hit


def parse_capacities(text: str, num_unique: int) -> list[int]:
    """ "1000,5%" -> block counts (a percentage is of the unique blocks, at least 1)."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        try:
            value = (
                max(1, round(float(item[:-1]) / 100 * num_unique))
                if item.endswith("%")
                else int(item)
            )
        except ValueError:
            raise ValueError(
                f"capacity {item!r} is neither a block count nor a percentage"
            ) from None
        if value < 1:
            raise ValueError(f"capacity {item!r} must be at least 1 block")
        out.append(value)
    if not out:
        raise ValueError("give at least one capacity")
    return sorted(set(out))


def parse_policies(text: str) -> list[str]:
    if text == "all":
        return list(POLICIES)
    names = [s.strip() for s in text.split(",") if s.strip()]
    for name in names:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose from {list(POLICIES)} or 'all'")
    if not names:
        raise ValueError("give at least one policy")
    return names


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


def run(
    trace: BlockTrace,
    capacities: Sequence[int],
    policies: Sequence[str],
    show_progress: bool = False,
) -> dict[str, Any]:
    """Every policy at every capacity, with the offline figures: the report as a dict."""
    refs, tokens = trace.num_refs, int(trace.num_tokens.sum())
    jobs = len(capacities) * (len(policies) + 2)
    bar = tqdm(total=refs * jobs, unit="ref", unit_scale=True, disable=not show_progress)
    done = 0

    def progress(pos: int) -> None:
        bar.update(done + pos - bar.n)

    results = []
    for capacity in capacities:
        bar.set_description(f"{capacity} blocks: bounds")
        optimal = upper_bound_hits(trace, capacity, progress)
        done += refs
        offline = offline_leaf_hits(trace, capacity, progress).block_hits
        done += refs
        for policy in policies:
            bar.set_description(f"{capacity} blocks: {policy}")
            got = replay(trace, policy, capacity, progress)
            done += refs
            rate = got.block_hits / refs if refs else 0.0
            results.append(
                {
                    "policy": policy,
                    "capacity_blocks": capacity,
                    "block_hit_rate": round(rate, 6),
                    "token_hit_rate": round(got.token_hits / tokens if tokens else 0.0, 6),
                    "optimal_block_hit_rate": round(optimal / refs if refs else 0.0, 6),
                    "offline_block_hit_rate": round(offline / refs if refs else 0.0, 6),
                    "ratio_to_optimal": _ratio(got.block_hits, optimal),
                    "ratio_to_offline": _ratio(got.block_hits, offline),
                }
            )
    bar.update(refs * jobs - bar.n)
    bar.close()
    return {**trace_summary(trace), "results": results}


def trace_summary(trace: BlockTrace) -> dict[str, Any]:
    """The report's fields about the trace itself."""
    stats, refs = trace.stats(), trace.num_refs
    return {
        "workload": trace.name,
        "block_tokens": trace.block_tokens,
        "requests": stats.requests,
        "block_refs": stats.block_refs,
        "unique_blocks": stats.unique_blocks,
        "mean_input_tokens": round(stats.mean_input_tokens, 1),
        "infinite_block_hit_rate": round(infinite_hits(trace) / refs if refs else 0.0, 6),
    }


# --- output --------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _rows(report: dict[str, Any]) -> list[list[str]]:
    unique = report["unique_blocks"]
    return [
        [
            f"{r['capacity_blocks']:,} ({_pct(r['capacity_blocks'] / unique if unique else None)})",
            r["policy"],
            _pct(r["block_hit_rate"]),
            _pct(r["token_hit_rate"]),
            _pct(r["offline_block_hit_rate"]),
            _pct(r["optimal_block_hit_rate"]),
            "-" if r["ratio_to_offline"] is None else f"{r['ratio_to_offline']:.2f}",
            "-" if r["ratio_to_optimal"] is None else f"{r['ratio_to_optimal']:.2f}",
        ]
        for r in report["results"]
    ]


COLUMNS = (
    "capacity (of unique)",
    "policy",
    "block hit",
    "token hit",
    "offline ref",
    "upper bound",
    "/ offline",
    "/ upper",
)


def _summary(report: dict[str, Any]) -> str:
    return (
        f"{report['workload']}: {report['requests']:,} requests, {report['block_refs']:,} block "
        f"references, {report['unique_blocks']:,} unique blocks of {report['block_tokens']} "
        f"tokens, mean input {report['mean_input_tokens']:,.0f} tokens; infinite-capacity "
        f"block hit rate {_pct(report['infinite_block_hit_rate'])}"
    )


def markdown(report: dict[str, Any]) -> str:
    lines = [_summary(report), "", "| " + " | ".join(COLUMNS) + " |"]
    lines.append("|" + "|".join("---:" for _ in COLUMNS) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in _rows(report)]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Block hit rate vs capacity: one line per policy, both offline figures, infinite."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in results):
        rows = [r for r in results if r["policy"] == policy]
        ax.plot(
            [r["capacity_blocks"] for r in rows],
            [r["block_hit_rate"] for r in rows],
            "o-",
            label=policy,
        )
    first = [r for r in results if r["policy"] == results[0]["policy"]]
    caps = [r["capacity_blocks"] for r in first]
    ax.plot(caps, [r["offline_block_hit_rate"] for r in first], "k:", label="offline reference")
    ax.plot(caps, [r["optimal_block_hit_rate"] for r in first], "k--", label="upper bound")
    ax.axhline(report["infinite_block_hit_rate"], color="grey", lw=0.8, label="infinite")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("block hit rate")
    ax.set_title(report["workload"])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(report: dict[str, Any], out: Path) -> None:
    write_report(report, out, markdown(report), plot)


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=_summary(report))
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for row in _rows(report):
        table.add_row(*row)
    Console().print(table)


# --- command line --------------------------------------------------------------------------
def load_workload(spec: str, params: list[str], block_size: int) -> BlockTrace:
    """`trace:PATH` or a generated workload with KEY=VALUE overrides, as a BlockTrace."""
    if spec.startswith("trace:"):
        if params:
            raise WorkloadError("--param applies to generated workloads, not to trace:PATH")
        return load_trace(spec[len("trace:") :], block_size)
    config = make_workload(spec, parse_params(params))
    return from_token_requests(config.generate(), block_size, spec)


def add_workload_arguments(parser: argparse.ArgumentParser, capacity_required: bool = True) -> None:
    """--workload, --param, --block-size and --capacity-blocks (see `parse_workload`)."""
    choices = ",".join([*WORKLOADS, "trace:PATH"])
    parser.add_argument("--workload", required=True, help=f"one of {{{choices}}}")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a generated workload's parameter (repeatable)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per block for generated workloads and token traces",
    )
    parser.add_argument(
        "--capacity-blocks",
        required=capacity_required,
        help="comma list of capacities: blocks, or %% of unique blocks",
    )


def parse_workload(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[BlockTrace, list[int]]:
    """The trace and capacities the workload arguments name (none when --capacity-blocks is
    optional and absent); a bad one exits with its error."""
    if args.block_size < 1:
        parser.error("--block-size must be >= 1")
    try:
        trace = load_workload(args.workload, args.param, args.block_size)
        if args.capacity_blocks is None:
            return trace, []
        return trace, parse_capacities(args.capacity_blocks, trace.num_unique)
    except (TraceError, WorkloadError, ValueError) as exc:
        parser.error(str(exc))


def _parser() -> argparse.ArgumentParser:
    from bench.hitrate import plan

    parser = argparse.ArgumentParser(
        prog="python -m bench hitrate",
        description="block and token hit rates of eviction policies vs offline figures",
    )
    add_workload_arguments(parser, capacity_required=False)
    parser.add_argument(
        "--policy", help="comma list of policies, or 'all' (default: all; lru when planning)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--out", type=Path, help="write hitrate.json/.md/.png into this dir")
    plan.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from bench.hitrate import plan

    parser = _parser()
    args = parser.parse_args(argv)
    planning = plan.requested(args)
    if not planning and args.capacity_blocks is None:
        parser.error("the following arguments are required: --capacity-blocks")
    if args.out is not None:  # before any work: no partial --out
        require("matplotlib", needed_by="--out")
    trace, capacities = parse_workload(parser, args)
    if planning:
        return plan.main(parser, args, trace, capacities)
    try:
        policies = parse_policies(args.policy or "all")
    except ValueError as exc:
        parser.error(str(exc))
    report = run(trace, capacities, policies, show_progress=not args.json)
    if args.out is not None:
        write_outputs(report, args.out)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0
