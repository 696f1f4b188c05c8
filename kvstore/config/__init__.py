"""The cache's configuration: `CacheConfig` (cache_config.py), built from flags, `KVSTORE_*`
variables and TOML (settings.py), with what each field means (help.py)."""

from kvstore.config.cache_config import (
    CODEC_NAMES,
    CODEC_TOLERANCE,
    LMDB_MIN_MAP_BYTES,
    POLICY_NAMES,
    POOL_CODECS,
    WRITE_POLICIES,
    CacheConfig,
    ConfigError,
)

__all__ = [
    "CODEC_NAMES",
    "CODEC_TOLERANCE",
    "LMDB_MIN_MAP_BYTES",
    "POLICY_NAMES",
    "POOL_CODECS",
    "WRITE_POLICIES",
    "CacheConfig",
    "ConfigError",
]
