"""What a quantized device pool (`kv_cache_dtype` int8 or fp8_e4m3) needs of the engine:
every attention read of a prompt goes through the pool, so a hit reads exactly what the miss
that wrote it read (docs/ARCHITECTURE.md, "Quantized pool")."""

from __future__ import annotations

from kvstore.config import ConfigError
from kvstore.device.pool import BlockPool


def unpaged_refusal(
    pool: BlockPool, paged: bool, model: str, why: str | None
) -> ConfigError | None:
    """The error for a quantized pool whose model cannot run paged (one request at a time
    would attend unquantized K/V), else None."""
    if paged or pool.scales is None:
        return None
    return ConfigError(
        "kv_cache_dtype",
        f"a quantized pool needs paged attention, which model {model} cannot run ({why}): "
        "give kv_cache_dtype auto",
    )


def refuse_per_request(pool: BlockPool) -> None:
    """`Engine.run`'s per-request path attends exact K/V: not on a quantized pool."""
    if pool.scales is not None:
        raise ConfigError(
            "kv_cache_dtype",
            "the per-request path attends exact K/V, so its misses would not be what a "
            "quantized pool's hits read: use generate or submit, or kv_cache_dtype auto",
        )
