"""RouterConfig: `kvstore router`'s settings, and its flags (standard library only, so a flag
error is reported before anything heavy loads)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from engine.api.keys import API_KEY_ENV, api_keys_from_args, check_api_key
from hashing import DEFAULT_SECRET
from kvstore.config import ConfigError
from kvstore.fleet.routing import RoutingConfig

POLICIES = ("kv", "round-robin")
SESSION_HEADER = "x-session-id"
HANDOVER_MIN_TOKENS = 512  # measured: docs/BENCHMARKS.md "Prefill and decode replicas"
SECRET_ENV = "KVSTORE_SECRET"  # the replicas' secret: the router derives tenant salts as they do


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(name, f"must be a number > 0, got {value!r}")


def check_replica_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise ConfigError("replica", f"expected http://HOST:PORT, got {url!r}")
    return url.rstrip("/")


@dataclass(frozen=True)
class RouterConfig:
    """Settings of `kvstore router`: the replicas it fronts and how it picks one."""

    replicas: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "kv"  # "round-robin": the baseline bench fleet compares against
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    api_keys: Mapping[str, str] = field(default_factory=dict, repr=False)  # key -> tenant
    health_interval_s: float = 0.1  # how often each replica's load and liveness are read
    stale_after_s: float = 3.0  # events older than this: route by load alone
    tier_events: bool = True  # price blocks in replicas' spill tiers (False: device only)
    connect_timeout_s: float = 2.0
    max_body_bytes: int = 4 << 20
    log_level: str = "info"
    secret: str = field(default="", repr=False)  # KVSTORE_SECRET: derives tenants' salts
    # a prompt with at least this many tokens uncached where it is served is prefilled on a
    # prefill replica first, when one shares a tier with it (engine/router/pairing.py)
    handover_min_tokens: int = HANDOVER_MIN_TOKENS
    # hand over only while some prefill replica queues fewer prompt tokens (None: always)
    handover_max_queued_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ConfigError("replica", "give at least one --replica http://HOST:PORT")
        if len(set(self.replicas)) != len(self.replicas):
            raise ConfigError("replica", "each replica once")
        for url in self.replicas:
            check_replica_url(url)
        if self.policy not in POLICIES:
            raise ConfigError("policy", f"choose from {POLICIES}, got {self.policy!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise ConfigError("port", f"must be an int, got {self.port!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be 0..65535, got {self.port}")
        for name in ("health_interval_s", "stale_after_s", "connect_timeout_s"):
            _check_positive(name, getattr(self, name))
        if not isinstance(self.tier_events, bool):
            raise ConfigError("tier_events", f"must be True or False, got {self.tier_events!r}")
        for key in self.api_keys:
            check_api_key(key)
        for name, least in (("handover_min_tokens", 0), ("handover_max_queued_tokens", 1)):
            value = getattr(self, name)
            if value is None and name == "handover_max_queued_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(name, f"must be an int >= {least}, got {value!r}")

    @property
    def secret_bytes(self) -> bytes:
        return self.secret.encode() if self.secret else DEFAULT_SECRET


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = RoutingConfig()
    parser.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help="a `kvstore serve` replica, http://HOST:PORT (repeat for each); replicas that "
        "publish KV events (--kv-events-port) are routed by their cache",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument(
        "--policy", default="kv", choices=POLICIES, help="kv (default) or round-robin"
    )
    parser.add_argument(
        "--prefill-weight",
        type=float,
        default=defaults.prefill_weight,
        help="cost per token to prefill there: the request's uncached tokens and the "
        f"replica's queued ones (default {defaults.prefill_weight})",
    )
    parser.add_argument(
        "--decode-weight",
        type=float,
        default=defaults.decode_weight,
        help="cost per token of KV held by the replica's running requests "
        f"(default {defaults.decode_weight})",
    )
    parser.add_argument(
        "--cache-key-load-slack",
        type=float,
        default=defaults.key_load_slack,
        metavar="COST",
        help="a prompt_cache_key stays on its replica while that replica's queued and "
        "running load costs at most this much more than the least loaded one's, in "
        f"prefill-token units (default {defaults.key_load_slack:g})",
    )
    for medium, name in (("host-memory", "host"), ("LMDB", "disk"), ("Redis", "redis")):
        parser.add_argument(
            f"--{name}-block-cost",
            type=float,
            default=getattr(defaults, f"{name}_block_cost"),
            metavar="FRACTION",
            help=f"loading a block from a replica's {medium} tier, as a fraction of "
            f"prefilling it, 0..1 (default {getattr(defaults, f'{name}_block_cost'):g}), until "
            "the replica publishes the one it measured",
        )
    parser.add_argument(
        "--device-affinity",
        type=float,
        default=defaults.device_affinity,
        metavar="FRACTION",
        help="each prefix block a replica holds on its device also counts this fraction of "
        "its prefill in that replica's favour: a turn sent elsewhere strands the device copy "
        f"(default {defaults.device_affinity:g})",
    )
    parser.add_argument(
        "--stale-after-s",
        type=float,
        default=3.0,
        help="a replica's events older than this: route by load alone (default 3)",
    )
    parser.add_argument(
        "--device-events-only",
        action="store_true",
        help="route by the replicas' device pools alone, ignoring their spill tiers' events "
        "(the baseline `bench fleet --scenarios host-tiers` compares against)",
    )
    parser.add_argument(
        "--handover-min-tokens",
        type=int,
        default=HANDOVER_MIN_TOKENS,
        metavar="N",
        help="with `--role prefill` replicas in the fleet: a prompt with at least N tokens "
        "uncached on the replica that serves it is prefilled on a prefill replica first and "
        f"handed over through their shared tier (default {HANDOVER_MIN_TOKENS}; 0: every "
        "prompt)",
    )
    parser.add_argument(
        "--handover-max-queued-tokens",
        type=int,
        default=None,
        metavar="N",
        help="hand a prompt over only while some prefill replica queues fewer than N prompt "
        "tokens, else the replica that serves it computes it (default: no bound; the "
        "prefill replicas' queue then absorbs a burst and the decodes stay smooth)",
    )
    parser.add_argument("--api-key", default=None, help=f"API key (default: ${API_KEY_ENV})")
    parser.add_argument("--api-keys-file", default=None, help='JSON {"key": "tenant", ...}')
    parser.add_argument("--log-level", default="info", help="uvicorn's and kvstore's level")


def router_config_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> RouterConfig:
    env = os.environ if env is None else env
    keys = api_keys_from_args(args, env)
    try:
        routing = RoutingConfig(
            args.prefill_weight,
            args.decode_weight,
            args.cache_key_load_slack,
            args.host_block_cost,
            args.disk_block_cost,
            args.redis_block_cost,
            args.device_affinity,
        )
    except ValueError as e:
        raise ConfigError("routing", str(e)) from None
    return RouterConfig(
        replicas=tuple(check_replica_url(u) for u in args.replica),
        host=args.host,
        port=args.port,
        policy=args.policy,
        routing=routing,
        api_keys=keys,
        stale_after_s=args.stale_after_s,
        tier_events=not args.device_events_only,
        log_level=args.log_level,
        secret=env.get(SECRET_ENV, ""),
        handover_min_tokens=args.handover_min_tokens,
        handover_max_queued_tokens=args.handover_max_queued_tokens,
    )
