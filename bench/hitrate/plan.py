"""Capacity planning: `bench hitrate` over tier hierarchies and replica fleets.

    python -m bench hitrate --workload ... [--capacity-blocks N,...]
        --tiers device[:C],memory:C,lmdb:C,redis:C [--tiers ...]
        [--write-policy TIER=POLICY,...] [--replicas N,...] [--route ROUTE,...]
        [--prefill-ms-per-token MS --load-ms-per-block TIER=MS,...]
        [--decode-ms-per-token MS] [--prefill-weight W] [--decode-weight W]
        [--host-block-cost F] [--disk-block-cost F] [--redis-block-cost F]

Any of these flags switches `bench hitrate` to this mode (the policy then defaults to lru, the
cache's default). Each `--tiers` is one hierarchy per replica, fastest first; a capacity is
blocks or a percentage of the trace's unique blocks. A hierarchy without `device:C` takes
each `--capacity-blocks` value as its device capacity. Every hierarchy runs with every
policy, replica count and route (one replica: the first route only, all are the same).
Every replica times its requests by the service model of `bench.hitrate.fleet` (prefill
`--prefill-ms-per-token`, else its default, and `--decode-ms-per-token`); the `kv` route
weighs that load against the cache with `--prefill-weight` and `--decode-weight`, and prices
a block each replica holds in a spill tier by `--host-block-cost` (memory), `--disk-block-cost`
(LMDB) and `--redis-block-cost` (kvstore/fleet/routing.py).

Each result row keeps the plain mode's fields, with `capacity_blocks` the blocks of every
tier of the fleet (a replica's private tiers times the replicas, plus the shared Redis) and
the offline figures at that capacity: a hit needs its block in some tier, and a block enters
the tiers only when a request computes it, so the tiers' union is a demand-filled cache of
that many blocks and `optimal_block_hit_rate` still bounds the fleet's total hit rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from bench.hitrate import parse_capacities, parse_policies, trace_summary
from bench.hitrate.cost import CostModel, parse_assignments
from bench.hitrate.fleet import (
    ROUTES,
    FleetConfig,
    FleetResult,
    ServiceModel,
    check_route,
    replay_fleet,
)
from bench.hitrate.keysets import LOWER_TIERS
from bench.hitrate.offline import offline_leaf_hits, upper_bound_hits
from bench.hitrate.plan_flags import KV_FLAGS, ROUTING, SERVICE, add_arguments, requested
from bench.hitrate.tiers import TIERS, TierConfig
from bench.traces import BlockTrace
from kvstore.fleet.routing import RoutingConfig

__all__ = ["add_arguments", "build_configs", "main", "requested", "run_plan"]


# --- parsing -------------------------------------------------------------------------------
def _one_capacity(text: str, num_unique: int, item: str) -> int:
    if "," in text or not text.strip():
        raise ValueError(f"--tiers item {item!r} needs one capacity (blocks or N%)")
    return parse_capacities(text, num_unique)[0]


def parse_tier_spec(text: str, num_unique: int) -> tuple[int | None, tuple[tuple[str, int], ...]]:
    """ "device:100,memory:5%" -> (100, (("memory", 920),)); device None when not given."""
    device: int | None = None
    spill: list[tuple[str, int]] = []
    for item in (s.strip() for s in text.split(",")):
        name, sep, cap = (part.strip() for part in item.partition(":"))
        if name not in TIERS:
            raise ValueError(f"--tiers: unknown tier {name!r} in {text!r}; tiers are {TIERS}")
        if name == TIERS[0]:
            if spill or device is not None:
                raise ValueError(f"--tiers {text!r}: name device once, first")
            device = _one_capacity(cap, num_unique, item) if sep else None
            continue
        if not sep:
            raise ValueError(f"--tiers item {item!r} needs a capacity: {name}:BLOCKS or {name}:N%")
        spill.append((name, _one_capacity(cap, num_unique, item)))
    return device, tuple(spill)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{flag} expects a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} expects integers >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def _routes(text: str | None) -> list[str]:
    routes = [s.strip() for s in (text or ROUTES[0]).split(",") if s.strip()]
    for route in routes:
        try:
            check_route(route)
        except ValueError as exc:
            raise ValueError(f"--route: {exc}") from None
    if not routes:
        raise ValueError(f"--route expects routes among {ROUTES}")
    return list(dict.fromkeys(routes))


def _write_policies(text: str | None, used: set[str]) -> dict[str, str]:
    if text is None:
        return {}
    given = parse_assignments(text, "--write-policy")
    for tier in given:
        if tier not in LOWER_TIERS:
            raise ValueError(f"--write-policy: {tier!r} has no write policy; use {LOWER_TIERS}")
        if tier not in used:
            raise ValueError(f"--write-policy names {tier!r}, which no --tiers configures")
    return given


def _hierarchies(
    specs: list[str], capacities: list[int], num_unique: int
) -> list[tuple[int, tuple[tuple[str, int], ...]]]:
    """(device blocks, spill tiers) of every --tiers, device capacities expanded."""
    out, used_capacities = [], False
    for spec in specs:
        device, spill = parse_tier_spec(spec, num_unique)
        if device is None and not capacities:
            raise ValueError(f"--tiers {spec!r} has no device:C; give it or --capacity-blocks")
        used_capacities |= device is None
        out += [(d, spill) for d in ([device] if device is not None else capacities)]
    if capacities and not used_capacities:
        raise ValueError("every --tiers names device:C, so --capacity-blocks would be unused")
    return out


def _option(value: float | None, default: float) -> float:
    return default if value is None else value


def _service(args: argparse.Namespace) -> ServiceModel:
    prefill = _option(args.prefill_ms_per_token, SERVICE.prefill_ms_per_token)
    decode = _option(args.decode_ms_per_token, SERVICE.decode_ms_per_token)
    try:
        return ServiceModel(prefill, decode)
    except ValueError as exc:
        raise ValueError(f"--{str(exc).replace('_', '-')}") from None


def _routing(args: argparse.Namespace, kv_used: bool) -> RoutingConfig:
    given = [name for name in KV_FLAGS if getattr(args, name) is not None]
    if given and not kv_used:
        flag = "--" + given[0].replace("_", "-")
        raise ValueError(f"{flag} weighs the kv route: add --route kv and --replicas N>1")
    try:
        return dataclasses.replace(ROUTING, **{name: getattr(args, name) for name in given})
    except ValueError as exc:
        raise ValueError(f"--{str(exc).replace('_', '-')}") from None


def build_configs(
    args: argparse.Namespace, trace: BlockTrace, capacities: list[int]
) -> list[FleetConfig]:
    """The fleets the flags name, in the order of the report's rows."""
    hierarchies = _hierarchies(args.tiers or ["device"], capacities, trace.num_unique)
    used = {name for _, spill in hierarchies for name, _ in spill}
    overrides = _write_policies(args.write_policy, used)
    policies = parse_policies(args.policy or "lru")
    replicas = _int_list(args.replicas or "1", "--replicas")
    routes = _routes(args.route)
    routing = _routing(args, "kv" in routes and max(replicas) > 1)
    service = _service(args)
    configs = []
    for device, spill in hierarchies:
        names = {name for name, _ in spill}
        writes = tuple((t, p) for t, p in overrides.items() if t in names)
        tiers = TierConfig(device, spill, writes)
        for policy in policies:
            for n in replicas:
                configs += [
                    FleetConfig(tiers, policy, n, r, routing, service)
                    for r in (routes if n > 1 else routes[:1])
                ]
    return configs


def build_cost(args: argparse.Namespace, configs: Sequence[FleetConfig]) -> CostModel | None:
    """The cost model the flags give, checked to cover every tier the fleets use."""
    if args.prefill_ms_per_token is None:
        if args.load_ms_per_block is not None:
            raise ValueError("--load-ms-per-block needs --prefill-ms-per-token")
        return None
    if args.load_ms_per_block is None:
        raise ValueError(
            "--prefill-ms-per-token needs --load-ms-per-block (e.g. device=0,memory=0.6)"
        )
    cost = CostModel.parse(args.prefill_ms_per_token, args.load_ms_per_block, TIERS)
    cost.check_covers(tuple(dict.fromkeys(t for c in configs for t in c.tiers.tiers)))
    return cost


# --- running -------------------------------------------------------------------------------
def _rate(n: int, of: int) -> float:
    return round(n / of, 6) if of else 0.0


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


def _routed_max_to_mean(routed: list[int]) -> float | None:
    """The busiest replica's requests over the mean (1.0: perfectly even)."""
    total = sum(routed)
    return round(max(routed) * len(routed) / total, 4) if total else None


def result_row(
    trace: BlockTrace,
    config: FleetConfig,
    result: FleetResult,
    bounds: tuple[int, int],
    cost: CostModel | None,
) -> dict[str, Any]:
    """One report row: the plain mode's fields, then the fleet's."""
    refs, tokens, bt = trace.num_refs, int(trace.num_tokens.sum()), trace.block_tokens
    tier_hits = result.tier_block_hits
    hits, (optimal, offline) = sum(tier_hits.values()), bounds
    row: dict[str, Any] = {
        "policy": config.policy,
        "capacity_blocks": config.total_blocks,
        "block_hit_rate": _rate(hits, refs),
        "token_hit_rate": _rate(hits * bt, tokens),
        "optimal_block_hit_rate": _rate(optimal, refs),
        "offline_block_hit_rate": _rate(offline, refs),
        "ratio_to_optimal": _ratio(hits, optimal),
        "ratio_to_offline": _ratio(hits, offline),
        "replicas": config.replicas,
        "route": config.route,
        "tier_capacity_blocks": config.tiers.capacities,
        "write_policy": config.tiers.write_policies,
        "tier_block_hits": dict(tier_hits),
        "tier_block_hit_rate": {t: _rate(n, refs) for t, n in tier_hits.items()},
        "tier_token_hit_rate": {t: _rate(n * bt, tokens) for t, n in tier_hits.items()},
        "requests_per_replica": result.routed,
        "routed_max_to_mean": _routed_max_to_mean(result.routed),
        "est_queue_wait_s": round(result.mean_wait_ms / 1000.0, 4),
        "service_model": dataclasses.asdict(config.service),
        "routing": dataclasses.asdict(config.routing) if config.route == "kv" else None,
    }
    if cost is not None:
        r = trace.num_requests
        row["est_ttft_s"] = round(cost.mean_ttft_s(tier_hits, tokens, r, bt), 4)
        row["est_ttft_nocache_s"] = round(cost.mean_nocache_s(tokens, r), 4)
    return row


def run_plan(
    trace: BlockTrace,
    configs: Sequence[FleetConfig],
    cost: CostModel | None = None,
    show_progress: bool = False,
) -> dict[str, Any]:
    """Every fleet replayed, with the offline figures at each fleet's total capacity."""
    refs = trace.num_refs
    totals = sorted({c.total_blocks for c in configs})
    bar = tqdm(
        total=refs * (2 * len(totals) + len(configs)),
        unit="ref",
        unit_scale=True,
        disable=not show_progress,
    )
    done = 0

    def progress(pos: int) -> None:
        bar.update(done + pos - bar.n)

    bounds = {}
    for total in totals:
        bar.set_description(f"{total} blocks: bounds")
        optimal = upper_bound_hits(trace, total, progress)
        done += refs
        bounds[total] = (optimal, offline_leaf_hits(trace, total, progress).block_hits)
        done += refs
    rows = []
    for config in configs:
        caps = "/".join(str(c) for c in config.tiers.capacities.values())
        bar.set_description(f"{config.replicas}x {config.route} {config.policy} {caps}")
        result = replay_fleet(trace, config, progress)
        done += refs
        rows.append(result_row(trace, config, result, bounds[config.total_blocks], cost))
    bar.update(bar.total - bar.n)
    bar.close()
    report = {**trace_summary(trace), "results": rows}
    if cost is not None:
        report["cost_model"] = cost.as_dict()
    return report


def main(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    trace: BlockTrace,
    capacities: list[int],
) -> int:
    """`bench hitrate` in planning mode: a bad flag exits with a one-line parser error."""
    from bench.hitrate import plan_output

    try:
        configs = build_configs(args, trace, capacities)
        cost = build_cost(args, configs)
    except ValueError as exc:
        parser.error(str(exc))
    report = run_plan(trace, configs, cost, show_progress=not args.json)
    if args.out is not None:
        plan_output.write_outputs(report, args.out)
    if args.json:
        print(json.dumps(report))
    else:
        plan_output.print_table(report)
    return 0
