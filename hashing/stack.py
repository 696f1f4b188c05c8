"""Namespaces and keys of a serving stack's blocks (vLLM, LMCache, SGLang adapters).

A stack hands its store an opaque key per block (its own chained hash) but no token ids.
Its blocks live under a `StackNamespace`: the stack, the model, the stack's KV layout and
dtype, and the tenant. A stack key maps to
- a lookup key: xxh3_128(namespace root || framed stack key), 16 bytes, what the tiers index;
- a verification digest: keyed BLAKE2b-128(verify root || framed stack key), which entries
  carry, so that a lookup-key collision, or an entry written without the deployment
  secret, reads as a miss.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import xxhash

from hashing.blocks import DEFAULT_SECRET, key_id
from hashing.namespace import FORMAT_VERSION, InvalidNamespace, _frame, validate_salt

STACK_FORMAT_VERSION = FORMAT_VERSION
MAX_STACK_KEY_BYTES = 4096


@dataclass(frozen=True)
class StackNamespace:
    """Identity of one stack's KV blocks. Different namespaces => disjoint keys.

    `layout` is the stack's description of a block's bytes (shapes, layers, parallelism);
    anything that changes the bytes of a block must change it.
    """

    stack: str
    model: str
    layout: str
    dtype: str
    tenant: str = ""
    format_version: int = STACK_FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("stack", "model", "layout", "dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or not value.isprintable():
                raise InvalidNamespace(f"{name} must be a non-empty printable str, got {value!r}")
        validate_salt(self.tenant)

    def framed(self) -> bytes:
        fields = (self.format_version, self.stack, self.model, self.layout, self.dtype)
        return b"kvstore-stack-namespace" + b"".join(_frame(f) for f in (*fields, self.tenant))

    def root(self) -> bytes:
        """The namespace field of this namespace's entries (16 bytes)."""
        return xxhash.xxh3_128_digest(self.framed())

    @property
    def id(self) -> str:
        """Short printable id (hex of the root): the key prefix in shared tiers."""
        return self.root().hex()[:16]


class StackHasher:
    """Lookup keys and verification digests of one stack namespace's keys."""

    def __init__(self, namespace: StackNamespace, secret: bytes = DEFAULT_SECRET):
        if not secret:
            raise ValueError("secret must be non-empty bytes")
        self.namespace = namespace
        self.root = namespace.root()
        self._verify_root = hashlib.blake2b(namespace.framed(), digest_size=16, key=secret)
        self.key_id = key_id(secret)

    def key(self, stack_key: bytes) -> bytes:
        return xxhash.xxh3_128_digest(self.root + _framed_key(stack_key))

    def digest(self, stack_key: bytes) -> bytes:
        h = self._verify_root.copy()
        h.update(_framed_key(stack_key))
        return h.digest()


def _framed_key(stack_key: bytes) -> bytes:
    if not isinstance(stack_key, bytes) or not 0 < len(stack_key) <= MAX_STACK_KEY_BYTES:
        limit = MAX_STACK_KEY_BYTES
        raise ValueError(f"a stack key must be 1..{limit} bytes, got {stack_key!r:.60}")
    return len(stack_key).to_bytes(4, "little") + stack_key
