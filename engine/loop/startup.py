"""What an engine starts with: the model's cache, the self-tested paged runner (armed with
the prefill clock the read gate weighs tier reads against, and decode graphs), and what a
quantized device pool requires of them: every attention read of a prompt through the pool,
so a hit reads exactly what the miss that wrote it read (docs/ARCHITECTURE.md, "Quantized
pool")."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.loop.graph import GraphConfig
from engine.loop.prefill_clock import PrefillClock
from engine.loop.runner import PagedRunner, start_paged
from engine.model.loading import LoadedModel, hybrid_window, shared_window
from hashing import Namespace
from kvstore.block_tables import BlockTables
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig, ConfigError
from kvstore.device.pool import BlockPool
from kvstore.fleet.events import EventSink


def cache_for(
    model: LoadedModel, config: CacheConfig, namespace: Namespace, events: EventSink | None
) -> PrefixCache:
    """The model's cache: a window model's requests drop the blocks that leave their window,
    a hybrid model's the window layers' part of them (docs/ARCHITECTURES.md)."""
    hybrid = hybrid_window(model.model.config)
    window, layers = hybrid if hybrid is not None else (shared_window(model.model.config), None)
    return PrefixCache(config, namespace, events=events, window=window, window_layers=layers)


def start_runner(
    model: LoadedModel,
    tables: BlockTables,
    kernel: str,
    observe_prefill: Callable[[int, float], None],
    graphs: GraphConfig,
    sampled: torch.Tensor,
) -> tuple[PagedRunner | None, str | None]:
    """`start_paged`, its runner timing its prefills for `observe_prefill` and replaying
    decode graphs when `graphs` asks (on the loop thread, as every step)."""
    runner, why = start_paged(model, tables, kernel)
    if runner is not None:
        runner.prefill_clock = PrefillClock(observe_prefill, runner.pool.device)
        if runner.graphable and graphs.enabled:
            runner.use_graphs(sampled, graphs.mode == "on")
    return runner, why


def unpaged_refusal(
    pool: BlockPool, paged: bool, model: str, why: str | None
) -> ConfigError | None:
    """The error for a quantized pool whose model cannot run paged (one request at a time
    would attend unquantized K/V), else None."""
    if paged or not pool.quantized:
        return None
    return ConfigError(
        "kv_cache_dtype",
        f"a quantized pool needs paged attention, which model {model} cannot run ({why}): "
        "give kv_cache_dtype auto",
    )


def refuse_per_request(pool: BlockPool) -> None:
    """`Engine.run`'s per-request path attends exact K/V: not on a quantized pool."""
    if pool.quantized:
        raise ConfigError(
            "kv_cache_dtype",
            "the per-request path attends exact K/V, so its misses would not be what a "
            "quantized pool's hits read: use generate or submit, or kv_cache_dtype auto",
        )
