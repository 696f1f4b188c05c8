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
capacity instead: tier hierarchies and replica fleets (`bench.hitrate.plan`). `--retain-s T`
replays a retention rule against LRU instead (`bench.hitrate.retention`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.hitrate.offline import infinite_hits, offline_leaf_hits, upper_bound_hits
from bench.hitrate.output import print_table, write_outputs
from bench.hitrate.simulate import ReplayResult, replay
from bench.traces import BlockTrace, TraceError, from_token_requests, load_trace
from bench.workloads import WORKLOADS, WorkloadError, make_workload, parse_params
from engine.extras import require
from kvstore.index.policies import POLICIES

__all__ = ["ReplayResult", "main", "parse_capacities", "replay", "run", "trace_summary"]


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
    from bench.hitrate import plan, retention

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
    retention.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from bench.hitrate import plan

    parser = _parser()
    args = parser.parse_args(argv)
    planning = plan.requested(args)
    if args.retain_s is not None or args.retain_max_fraction is not None:
        from bench.hitrate import retention

        if planning:
            parser.error("--retain-s compares against LRU on one device: no planning flags")
        return retention.main(parser, args)
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
