"""CacheConfig: the one frozen configuration of the cache layer, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from hashing.namespace import KV_CACHE_DTYPES, validate_salt

if TYPE_CHECKING:
    from hashing import Namespace

POLICY_NAMES = ("lru", "lfu", "slru", "s3fifo", "as3fifo", "arc", "lhd")
CODEC_NAMES = ("none", "fp16", "bf16", "lz4", "zstd", "int8", "fp8")
# Max |logit change| each tier codec may cause against the no-cache reference. Lossless: the
# fp32 contract. fp16 keeps 11 significant bits: the contract's 16-bit tolerance. bf16 keeps
# 8: eight times fp16's rounding error, so eight times its tolerance. int8 rounds to a step
# of amax/127 per token and head: at a typical value (a third to a quarter of that amax)
# three to four times bf16's error. fp8 (e4m3) keeps 4 significant bits: sixteen times
# bf16's error. docs/FORMAT.md, "Payload codecs".
_BF16 = 8 * 2e-2
CODEC_TOLERANCE = {"none": 1e-4, "lz4": 1e-4, "zstd": 1e-4, "fp16": 2e-2, "bf16": _BF16,
                   "int8": 4 * _BF16, "fp8": 16 * _BF16}  # fmt: skip
WRITE_POLICIES = ("write-through", "write-back", "selective", "off")
# a quantized pool's blocks go to the tiers as they are: entries of this codec
POOL_CODECS = {"int8": "int8", "fp8_e4m3": "fp8"}


class ConfigError(ValueError):
    """A configuration field is invalid; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _positive(name: str, value: float | int | None, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(name, f"must be a positive number, got {value!r}")


LMDB_MIN_MAP_BYTES = 64 * 4096  # LMDB's map must hold its meta and a few pages


@dataclass(frozen=True)
class CacheConfig:
    """Configuration of `PrefixCache` and its tiers. All sizes are per process."""

    block_size: int = 16
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:N"
    device_cache_gb: float | None = None  # pool size in bytes; used when device_blocks is None
    device_blocks: int | None = None  # pool size in blocks; wins over device_cache_gb
    eviction_policy: str = "lru"
    secret: str = ""  # verification-digest key (deployment secret); empty = fixed default
    tenant_salt: str = ""
    key_bytes: int = 16  # test hook: < 16 truncates lookup keys to force collisions
    tenant_quota_blocks: int | None = None  # most device blocks one owner (tenant) may hold
    retention_max_fraction: float = 0.5  # of the pool, retained by clients in total
    retention_quota_blocks: int | None = None  # most device blocks one tenant may retain
    tail_blocks: int | None = None  # partial last blocks kept for the next turn; None: auto
    window_share: float = 0.5  # a hybrid model's window-layer slots per pool block, in (0, 1]
    kv_cache_dtype: str = "auto"  # the pool's storage: the model's dtype, int8 or fp8_e4m3
    # --- spill tiers (all off by default) ---
    memory_cache_gb: float = 0.0  # host-RAM tier; 0 = off
    lmdb_dir: str | None = None
    lmdb_map_size_gb: float = 4.0
    redis_url: str | None = None  # redis://, rediss://, unix://, redis(s)+cluster://
    redis_ttl_s: int | None = None
    lookup_deadline_ms: float = 200.0  # one deadline per tier lookup
    breaker_failures: int = 3  # consecutive failures that open a tier's circuit breaker
    breaker_cooldown_s: float = 5.0
    codec: str = "none"
    chunk_blocks: int = 1  # blocks per stored entry
    layer_loads: bool = False  # tier hits reach the pool layer by layer during the forward
    tier_read_gate: bool = True  # read a tier only when fetching beats recomputing
    tier_reprobe_s: float = 30.0  # a tier the gate skipped is read again after this long
    redis_write_policy: str = "write-through"
    lmdb_write_policy: str = "write-through"
    memory_write_policy: str = "write-back"
    selective_min_hits: int = 2
    write_queue_blocks: int = 4096  # bound of the background write queue
    flush_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 4096:
            raise ConfigError("block_size", f"must be an int in [1, 4096], got {self.block_size!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError("device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        _positive("device_cache_gb", self.device_cache_gb)
        if self.device_blocks is not None and (
            not isinstance(self.device_blocks, int) or self.device_blocks < 1
        ):
            raise ConfigError("device_blocks", f"must be an int >= 1, got {self.device_blocks!r}")
        self._check_choices()
        self._check_numbers()
        try:
            validate_salt(self.tenant_salt)
        except ValueError as e:
            raise ConfigError("tenant_salt", str(e)) from None

    def _check_choices(self) -> None:
        if self.eviction_policy not in POLICY_NAMES:
            raise ConfigError("eviction_policy", f"must be one of {POLICY_NAMES}")
        if self.codec not in CODEC_NAMES:
            raise ConfigError("codec", f"must be one of {CODEC_NAMES}, got {self.codec!r}")
        self._check_kv_cache_dtype()
        for name in ("redis_write_policy", "lmdb_write_policy", "memory_write_policy"):
            if getattr(self, name) not in WRITE_POLICIES:
                raise ConfigError(name, f"must be one of {WRITE_POLICIES}")
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://", "unix://")
        ):
            raise ConfigError(
                "redis_url",
                "must start with redis://, rediss:// (TLS), unix:// (a socket path), "
                "redis+cluster:// or rediss+cluster://",  # never the URL: it may hold a password
            )

    def _check_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}")
        pool_codec = POOL_CODECS.get(self.kv_cache_dtype)
        if pool_codec is None:
            return
        if self.codec not in ("none", pool_codec):
            why = f"a {self.kv_cache_dtype} pool's blocks reach the tiers as they are"
            raise ConfigError("codec", f"{why}: give none or {pool_codec}, not {self.codec!r}")
        if self.chunk_blocks != 1 or self.layer_loads:
            why = "a quantized pool reads and writes its tiers a block at a time and whole"
            raise ConfigError("kv_cache_dtype", f"{why}: chunk_blocks 1, layer_loads off")

    @property
    def entry_codec(self) -> str:
        """The codec of the tier entries: the pool's for a quantized pool, else `codec`."""
        return POOL_CODECS.get(self.kv_cache_dtype, self.codec)

    def _check_numbers(self) -> None:
        if not isinstance(self.key_bytes, int) or not 1 <= self.key_bytes <= 16:
            raise ConfigError("key_bytes", f"must be an int in [1, 16], got {self.key_bytes!r}")
        if self.memory_cache_gb < 0:
            raise ConfigError("memory_cache_gb", "must be >= 0")
        for name in ("lmdb_map_size_gb", "lookup_deadline_ms", "breaker_cooldown_s"):
            _positive(name, getattr(self, name), allow_none=False)
        if round(self.lmdb_map_size_gb * 2**30) < LMDB_MIN_MAP_BYTES:
            message = f"must be at least {LMDB_MIN_MAP_BYTES / 2**30:.12g} (256 KiB)"
            raise ConfigError("lmdb_map_size_gb", f"{message}, got {self.lmdb_map_size_gb!r}")
        for name in ("breaker_failures", "chunk_blocks", "selective_min_hits"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be an int >= 1, got {value!r}")
        if self.tenant_quota_blocks is not None and (
            not isinstance(self.tenant_quota_blocks, int) or self.tenant_quota_blocks < 1
        ):
            raise ConfigError("tenant_quota_blocks", "must be an int >= 1 or None")
        self._check_retention()
        if self.tail_blocks is not None and (
            isinstance(self.tail_blocks, bool)
            or not isinstance(self.tail_blocks, int)
            or self.tail_blocks < 0
        ):
            message = f"must be an int >= 0 or None, got {self.tail_blocks!r}"
            raise ConfigError("tail_blocks", message)
        share = self.window_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise ConfigError("window_share", f"must be a number in (0, 1], got {share!r}")
        if self.redis_ttl_s is not None and self.redis_ttl_s < 1:
            raise ConfigError("redis_ttl_s", "must be >= 1 second or None")
        _positive("write_queue_blocks", self.write_queue_blocks, allow_none=False)
        if not isinstance(self.layer_loads, bool):
            raise ConfigError("layer_loads", f"must be true or false, got {self.layer_loads!r}")
        _positive("flush_timeout_s", self.flush_timeout_s, allow_none=False)
        if not isinstance(self.tier_read_gate, bool):
            why = f"must be true or false, got {self.tier_read_gate!r}"
            raise ConfigError("tier_read_gate", why)
        _positive("tier_reprobe_s", self.tier_reprobe_s, allow_none=False)

    def _check_retention(self) -> None:
        frac = self.retention_max_fraction
        if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0 <= frac < 1:
            raise ConfigError("retention_max_fraction", f"must be in [0, 1), got {frac!r}")
        quota = self.retention_quota_blocks
        bad = isinstance(quota, bool) or not isinstance(quota, int) or quota < 1
        if quota is not None and bad:
            why = f"must be an int >= 1 or None, got {quota!r}"
            raise ConfigError("retention_quota_blocks", why)

    @property
    def has_tiers(self) -> bool:
        """Whether any spill tier (host memory, LMDB, Redis) is configured."""
        return self.memory_cache_gb > 0 or bool(self.lmdb_dir) or bool(self.redis_url)

    def bind(self, namespace: Namespace) -> Namespace:
        """The namespace this config caches under: the config's codec and tenant salt are
        part of it, so they are applied; a namespace naming other ones, or another block
        size, is refused."""
        if namespace.block_size != self.block_size:
            raise ConfigError(
                "block_size",
                f"namespace block_size {namespace.block_size} != config {self.block_size}",
            )
        if namespace.kv_cache_dtype not in ("auto", self.kv_cache_dtype):  # its pool is ours
            raise ConfigError(
                "kv_cache_dtype",
                f"namespace has {namespace.kv_cache_dtype!r}, config has {self.kv_cache_dtype!r}",
            )
        if self.kv_cache_dtype != "auto":
            namespace = replace(namespace, kv_cache_dtype=self.kv_cache_dtype)
        for name, field, default in (("entry_codec", "codec", "none"),
                                     ("tenant_salt", "salt", "")):  # fmt: skip
            ns_value, cfg_value = getattr(namespace, field), getattr(self, name)
            if ns_value != cfg_value and default not in (ns_value, cfg_value):
                why = f"namespace has {ns_value!r}, config has {cfg_value!r}"
                raise ConfigError("codec" if name == "entry_codec" else name, why)
            if cfg_value != default:
                namespace = replace(namespace, **{field: cfg_value})
        return namespace

    @property
    def secret_bytes(self) -> bytes:
        from hashing import DEFAULT_SECRET

        return self.secret.encode() if self.secret else DEFAULT_SECRET

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
