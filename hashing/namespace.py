"""The namespace a block hash lives in: everything that makes KV valid or invalid to share."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import xxhash

# The entry format version (kvstore.entry) is this one: a new format is a new namespace, so
# entries of two formats never share a key (a new release never finds, nor blocks, old ones).
FORMAT_VERSION = 3
MAX_SALT_CHARS = 256
KV_DTYPES = ("float32", "float16", "bfloat16")
# the device pool's storage: the model's dtype (auto), or int8 / fp8 values with a scale per
# token (docs/FORMAT.md, "Quantized payloads": a pool block holds such a payload)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")


class InvalidNamespace(ValueError):
    """A namespace field is malformed (the message names the field)."""


def validate_salt(salt: str) -> str:
    """Return `salt` if it is at most 256 printable characters; empty means no salt."""
    if not isinstance(salt, str):
        raise InvalidNamespace(f"salt must be a str, got {type(salt).__name__}")
    if len(salt) > MAX_SALT_CHARS:
        raise InvalidNamespace(f"salt is {len(salt)} characters; at most {MAX_SALT_CHARS}")
    if not salt.isprintable():
        raise InvalidNamespace("salt must contain only printable characters")
    return salt


def combine_salts(base: str, salt: str) -> str:
    """The salt of a request with its own `salt` under a deployment/tenant salt `base`: it can
    only narrow sharing (a request salt never reaches another base's blocks)."""
    validate_salt(salt)
    if not base or not salt:
        return base or salt
    return hashlib.blake2b(_frame(base) + _frame(salt), digest_size=16).hexdigest()


def _frame(value: str | int) -> bytes:
    # Length-prefixed so that ("org_1", "2345") and ("org_12345", "") never collide.
    raw = str(value).encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


@dataclass(frozen=True)
class Namespace:
    """Identity of a KV cache: model, KV format and tenant. Different namespace => disjoint keys."""

    model_fingerprint: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    codec: str = "none"
    adapter_id: str = ""
    salt: str = ""
    format_version: int = FORMAT_VERSION
    kv_cache_dtype: str = "auto"  # a quantized pool's KV differs from an auto pool's

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise InvalidNamespace("model_fingerprint must be a non-empty string")
        if self.kv_dtype not in KV_DTYPES:
            raise InvalidNamespace(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidNamespace(f"{name} must be a positive int, got {value!r}")
        validate_salt(self.salt)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidNamespace(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )

    def framed(self) -> bytes:
        fields = (
            self.format_version,
            self.model_fingerprint,
            self.kv_dtype,
            f"{self.num_layers}x{self.num_kv_heads}x{self.head_dim}",
            self.block_size,
            self.codec,
            self.adapter_id,
            self.salt,
        )
        if self.kv_cache_dtype != "auto":  # auto's roots are those of before the field
            fields = (*fields, f"kv_cache_dtype={self.kv_cache_dtype}")
        return b"kvstore-namespace" + b"".join(_frame(f) for f in fields)

    def root(self) -> bytes:
        """Parent key of block 0 (16 bytes)."""
        return xxhash.xxh3_128_digest(self.framed())

    def verify_root(self, secret: bytes) -> bytes:
        """Parent verification digest of block 0 (16 bytes), keyed by the deployment secret."""
        return hashlib.blake2b(self.framed(), digest_size=16, key=secret).digest()

    def with_salt(self, salt: str) -> Namespace:
        return Namespace(**{**self.__dict__, "salt": salt})

    @property
    def id(self) -> str:
        """Short printable id (hex of the root), used as a key prefix in shared tiers."""
        return self.root().hex()[:16]
