"""The command-line flags of capacity planning (`bench hitrate --tiers ...`, plan.py): their
definitions and defaults, and whether any was given."""

from __future__ import annotations

import argparse

from bench.hitrate.fleet import ROUTES, ServiceModel
from kvstore.fleet.routing import RoutingConfig

# weights of the kv route only
KV_FLAGS = (
    "prefill_weight",
    "decode_weight",
    "host_block_cost",
    "disk_block_cost",
    "redis_block_cost",
    "device_affinity",
)
FLAGS = (
    "tiers",
    "write_policy",
    "replicas",
    "route",
    "prefill_ms_per_token",
    "load_ms_per_block",
    "decode_ms_per_token",
    *KV_FLAGS,
)
SERVICE = ServiceModel()
ROUTING = RoutingConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("capacity planning (tier hierarchies, replica fleets)")
    group.add_argument(
        "--tiers",
        action="append",
        metavar="SPEC",
        help="device[:C],memory:C,lmdb:C,redis:C per replica, fastest first (repeatable); "
        "C in blocks or %% of unique; no device:C = each --capacity-blocks value",
    )
    group.add_argument(
        "--write-policy",
        metavar="TIER=POLICY,...",
        help="override the cache's default write policy of spill tiers "
        "(write-through, write-back, selective, off)",
    )
    group.add_argument("--replicas", metavar="N,...", help="replica counts (default 1)")
    group.add_argument("--route", metavar="ROUTE,...", help=f"routes among {','.join(ROUTES)}")
    group.add_argument("--prefill-ms-per-token", type=float, metavar="MS", help="prefill cost")
    group.add_argument(
        "--load-ms-per-block", metavar="TIER=MS,...", help="load cost of a hit block per tier"
    )
    group.add_argument(
        "--decode-ms-per-token",
        type=float,
        metavar="MS",
        help="service time per output token (default "
        f"{SERVICE.decode_ms_per_token:g}; traces carry no output lengths: outputs count 0)",
    )
    group.add_argument(
        "--prefill-weight",
        type=float,
        metavar="W",
        help=f"kv route: cost per token to prefill (default {ROUTING.prefill_weight:g})",
    )
    group.add_argument(
        "--decode-weight",
        type=float,
        metavar="W",
        help=f"kv route: cost per token of running requests (default {ROUTING.decode_weight:g})",
    )
    for tier, name in (("memory", "host"), ("lmdb", "disk"), ("redis", "redis")):
        default = getattr(ROUTING, f"{name}_block_cost")
        group.add_argument(
            f"--{name}-block-cost",
            type=float,
            metavar="F",
            help=f"kv route: loading a {tier} block, as a fraction of its prefill "
            f"(default {default:g})",
        )
    group.add_argument(
        "--device-affinity",
        type=float,
        metavar="F",
        help="kv route: each prefix block on a replica's device also worth this fraction of "
        f"its prefill there (default {ROUTING.device_affinity:g})",
    )


def requested(args: argparse.Namespace) -> bool:
    """Whether any capacity-planning flag was given."""
    return any(getattr(args, name) is not None for name in FLAGS)
