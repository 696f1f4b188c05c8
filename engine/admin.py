"""`kvstore stats` and `kvstore clear`: inspect and empty the spill tiers of one namespace.

The namespace is the model's (from `--model`, fingerprinted like `generate` does), or given
directly with `--namespace ID` (the 16-hex-digit id `stats` prints), which needs no model.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from engine.commands import (
    add_cache_arguments,
    add_model_arguments,
    cache_config_from_args,
    command,
)
from kvstore.config import CacheConfig, ConfigError
from kvstore.stores import SpillStore, make_stores


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", default=None, help="namespace id (skips loading a model)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_arguments(parser)
    add_cache_arguments(parser)


def _namespace_id(args: argparse.Namespace, config: CacheConfig) -> str:
    if args.namespace is not None:
        ns_id = args.namespace.lower()
        if len(ns_id) != 16 or any(c not in "0123456789abcdef" for c in ns_id):
            raise ConfigError("namespace", f"must be 16 hex digits, got {args.namespace!r}")
        return ns_id
    from engine.model import load_model

    model = load_model(args.model, args.dtype, "cpu", args.model_revision)
    return config.bind(model.namespace(config.block_size)).id


def _open(args: argparse.Namespace) -> tuple[str, list[SpillStore]]:
    config = cache_config_from_args(args)
    ns_id = _namespace_id(args, config)
    stores = [s for s in make_stores(config, ns_id) if s.name != "memory"]  # per process
    if not stores:
        raise ConfigError("tiers", "no shared tier configured: give --lmdb-dir or --redis-url")
    return ns_id, stores


def _tier_stats(store: SpillStore) -> dict:
    stats = asdict(store.stats())
    count = getattr(store, "count_entries", None)
    if stats["entries"] is None and count is not None:
        stats["entries"] = count()
    return stats


@command("stats", "entries, bytes, hits, failures and breaker state of each spill tier", _arguments)
def run_stats(args: argparse.Namespace) -> int:
    ns_id, stores = _open(args)
    report = {"namespace": ns_id, "tiers": {s.name: _tier_stats(s) for s in stores}}
    for store in stores:
        store.close()
    if args.json:
        print(json.dumps(report))
        return 0
    from rich.console import Console
    from rich.table import Table

    cols = ("entries", "bytes", "capacity_bytes", "verify_failures", "errors", "breaker_state")
    table = Table(title=f"kvstore shared tiers, namespace {ns_id}")
    table.add_column("tier")
    for col in cols:
        table.add_column(col, justify="right")
    for name, stats in report["tiers"].items():
        table.add_row(name, *("-" if stats[c] is None else str(stats[c]) for c in cols))
    Console(width=160).print(table)
    return 0


@command("clear", "delete every entry of one namespace from the spill tiers", _arguments)
def run_clear(args: argparse.Namespace) -> int:
    ns_id, stores = _open(args)
    removed = {store.name: store.clear() for store in stores}
    for store in stores:
        store.close()
    if args.json:
        print(json.dumps({"namespace": ns_id, "removed": removed}))
    else:
        done = ", ".join(f"{n} from {tier}" for tier, n in removed.items())
        print(f"namespace {ns_id}: removed {done}")
    return 0
