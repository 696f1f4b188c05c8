"""kvstore: the prefix-caching cache layer (no transformers import).

Public names are imported lazily so `kvstore.config` stays light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CacheConfig": "kvstore.config",
    "ConfigError": "kvstore.config",
    "PrefixCache": "kvstore.cache",
    "CacheHit": "kvstore.hits",
    "KVPrefix": "kvstore.hits",
    "QuantError": "kvstore.entry.quant",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
