"""`kvstore stats` and `kvstore clear`: inspect and empty the spill tiers of one namespace.

The namespace is the model's (from `--model`, fingerprinted like `generate` does), or given
directly with `--namespace ID` (the 16-hex-digit id `stats` prints), which needs no model.
The tiers are checked before any model loads: none configured, or an LMDB directory that
does not exist (these commands never create a store), is an error at once. They offer only
the flags that choose the namespace and reach the tiers.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

from engine.commands import DEFAULT_MODEL, add_model_flag, command
from kvstore.config import CacheConfig, ConfigError
from kvstore.config.settings import add_cache_args, config_from_args
from kvstore.stores import SpillStore, make_stores

TIER_FIELDS = ("entries", "bytes", "capacity_bytes")  # what `stats` reports of each tier
# the cache settings that choose a namespace and reach its shared tiers (the others are the
# device pool's and the writers': these commands have neither)
TIER_SETTINGS = ("block_size", "secret", "tenant_salt", "codec", "kv_cache_dtype",
                 "chunk_blocks", "lmdb_dir", "lmdb_map_size_gb", "redis_url",
                 "lookup_deadline_ms", "breaker_failures", "breaker_cooldown_s")  # fmt: skip


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", default=None, help="namespace id (skips loading a model)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_flag(parser, DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto", help="the model's dtype (its namespace's)")
    parser.add_argument(
        "--model-revision", default=None, help="the string the model's fingerprint was pinned by"
    )
    add_cache_args(parser, only=TIER_SETTINGS)


def _namespace_id(args: argparse.Namespace, config: CacheConfig) -> str:
    if args.namespace is not None:
        ns_id = args.namespace.lower()
        if len(ns_id) != 16 or any(c not in "0123456789abcdef" for c in ns_id):
            raise ConfigError("namespace", f"must be 16 hex digits, got {args.namespace!r}")
        return ns_id
    from engine.model.loading import load_model

    model = load_model(args.model, args.dtype, "cpu", args.model_revision)
    return config.bind(model.namespace(config.block_size)).id


def _open(args: argparse.Namespace) -> tuple[str, list[SpillStore]]:
    config = config_from_args(args)
    _check_tiers(config)  # before a model loads: a mistake costs a second, not a load
    ns_id = _namespace_id(args, config)
    stores = [s for s in make_stores(config, ns_id) if s.name != "memory"]  # per process
    return ns_id, stores


def _check_tiers(config: CacheConfig) -> None:
    """A shared tier configured, and an LMDB directory that exists (nothing is created)."""
    if config.lmdb_dir is None and config.redis_url is None:
        raise ConfigError("tiers", "no shared tier configured: give --lmdb-dir or --redis-url")
    path = None if config.lmdb_dir is None else os.path.expanduser(config.lmdb_dir)
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError("lmdb_dir", f"{path} exists and is not a directory; give a directory")
    if path is not None and not os.path.isdir(path):
        why = "no LMDB store there to read (a server or generate run makes it when it writes)"
        raise ConfigError("lmdb_dir", f"{config.lmdb_dir} does not exist: {why}")


def _tier_stats(store: SpillStore) -> dict:
    """What the tier holds and whether it answers now. Hit, write and error counters are kept
    per process: a running server's are on its /metrics, this process's would all be 0."""
    error = store.probe()
    stats = asdict(store.stats())
    report = {name: stats[name] for name in TIER_FIELDS}
    count = getattr(store, "count_entries", None)  # the namespace's own (bytes are the store's)
    if error is None and count is not None:
        report["entries"] = count()
    return {**report, "reachable": error is None, "error": error}


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvstore shared tiers, namespace {report['namespace']}")
    for col in ("tier", "reachable", *TIER_FIELDS, "error"):
        table.add_column(col, justify="left" if col in ("tier", "error") else "right")
    for name, tier in report["tiers"].items():
        sizes = ("-" if tier[c] is None else str(tier[c]) for c in TIER_FIELDS)
        reachable = "yes" if tier["reachable"] else "NO"
        table.add_row(name, reachable, *sizes, tier["error"] or "")
    Console(width=160).print(table)


@command(
    "stats",
    "entries and bytes of each spill tier, and whether it answers (exit 1 if one does not)",
    _arguments,
)
def run_stats(args: argparse.Namespace) -> int:
    ns_id, stores = _open(args)
    report = {"namespace": ns_id, "tiers": {s.name: _tier_stats(s) for s in stores}}
    for store in stores:
        store.close()
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
    return 0 if all(tier["reachable"] for tier in report["tiers"].values()) else 1


@command(
    "clear",
    "delete every entry of one namespace from the spill tiers (exit 1 if one does not answer)",
    _arguments,
)
def run_clear(args: argparse.Namespace) -> int:
    ns_id, stores = _open(args)
    unreachable = {s.name: error for s in stores if (error := s.probe()) is not None}
    removed = {s.name: None if s.name in unreachable else s.clear() for s in stores}
    for store in stores:
        store.close()
    if args.json:
        print(json.dumps({"namespace": ns_id, "removed": removed, "unreachable": unreachable}))
    else:
        done = [f"{n} from {tier}" for tier, n in removed.items() if n is not None]
        failed = [f"{tier} unreachable ({error})" for tier, error in unreachable.items()]
        print(f"namespace {ns_id}: removed " + "; ".join([", ".join(done) or "nothing", *failed]))
    return 1 if unreachable else 0
