"""Chained block keys and verification digests over token ids."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import xxhash

from hashing.namespace import Namespace

BlockHash = bytes  # 16 bytes
HASH_BYTES = 16
DEFAULT_SECRET = b"kvstore-default-verification-key"
KEY_ID_BYTES = 8
_U32_MAX = 2**32 - 1


def key_id(secret: bytes) -> bytes:
    """The 8-byte id of a deployment secret that entries carry (never the secret itself):
    a reader whose id differs knows the entry was written under another secret (foreign),
    not damaged."""
    if not isinstance(secret, bytes) or not secret:
        raise ValueError("secret must be non-empty bytes")
    return hashlib.blake2b(b"kvstore-key-id", digest_size=KEY_ID_BYTES, key=secret).digest()


DEFAULT_KEY_ID = key_id(DEFAULT_SECRET)


class InvalidTokens(ValueError):
    """Token ids are not a 1-D sequence of integers in [0, 2**32)."""


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous little-endian uint32 array, validated."""
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.dtype("<u4"):
        arr = token_ids
    else:
        try:
            raw = np.asarray(token_ids)
        except (TypeError, ValueError) as e:
            raise InvalidTokens(f"token ids must be a sequence of ints: {e}") from None
        if raw.size and raw.dtype.kind not in "iu":
            raise InvalidTokens(f"token ids must be integers, got dtype {raw.dtype}")
        if raw.size and (raw.min() < 0 or raw.max() > _U32_MAX):
            raise InvalidTokens("token ids must lie in [0, 2**32)")
        arr = raw.astype("<u4")
    if arr.ndim != 1:
        raise InvalidTokens(f"token ids must be 1-D, got shape {arr.shape}")
    return np.ascontiguousarray(arr)


def num_full_blocks(num_tokens: int, block_size: int) -> int:
    return num_tokens // block_size


def _frame_extra(extra: bytes | None) -> bytes:
    return b"" if extra is None else b"\x00x" + len(extra).to_bytes(4, "little") + extra


class BlockHasher:
    """Computes lookup keys and verification digests for one namespace.

    `key_bytes` < 16 truncates lookup keys (zero-padded to 16 bytes) to force collisions in
    tests; verification digests are never truncated.
    """

    def __init__(self, namespace: Namespace, secret: bytes = DEFAULT_SECRET, key_bytes: int = 16):
        if not 1 <= key_bytes <= HASH_BYTES:
            raise ValueError(f"key_bytes must be in [1, {HASH_BYTES}], got {key_bytes}")
        self.namespace = namespace
        self.block_size = namespace.block_size
        self.root = self._truncate(namespace.root(), key_bytes)
        self.verify_root = namespace.verify_root(secret)
        self.key_id = key_id(secret)
        self._secret = secret
        self._key_bytes = key_bytes

    @staticmethod
    def _truncate(key: bytes, key_bytes: int) -> bytes:
        return key if key_bytes == HASH_BYTES else key[:key_bytes] + bytes(HASH_BYTES - key_bytes)

    def _block_views(self, tokens: np.ndarray, start_block: int) -> list[memoryview]:
        n = num_full_blocks(len(tokens), self.block_size)
        step = self.block_size * 4
        buf = memoryview(tokens[: n * self.block_size].tobytes())
        return [buf[i * step : (i + 1) * step] for i in range(start_block, n)]

    def hash_blocks(
        self,
        token_ids: Sequence[int] | np.ndarray,
        extra_keys: Sequence[bytes | None] | None = None,
        parent: BlockHash | None = None,
        start_block: int = 0,
    ) -> list[BlockHash]:
        """Lookup keys of the full blocks from `start_block` on (`parent`: key before them)."""
        tokens = as_token_array(token_ids)
        views = self._block_views(tokens, start_block)
        key = self.root if parent is None else parent
        digest, kb, out = xxhash.xxh3_128_digest, self._key_bytes, []
        append = out.append
        if extra_keys is None and kb == HASH_BYTES:
            for view in views:  # hot path: one C call per block
                key = digest(key + view)
                append(key)
            return out
        for i, view in enumerate(views):
            extra = self._extra(extra_keys, start_block + i)
            key = self._truncate(digest(key + view + extra), kb)
            append(key)
        return out

    def digest_blocks(
        self,
        token_ids: Sequence[int] | np.ndarray,
        extra_keys: Sequence[bytes | None] | None = None,
        num_blocks: int | None = None,
    ) -> list[bytes]:
        """Verification digests (keyed BLAKE2b-128 chain) of the first `num_blocks` full blocks."""
        tokens = as_token_array(token_ids)
        views = self._block_views(tokens, 0)[:num_blocks]
        parent, out = self.verify_root, []
        for i, view in enumerate(views):
            data = parent + view + self._extra(extra_keys, i)
            parent = hashlib.blake2b(data, digest_size=16, key=self._secret).digest()
            out.append(parent)
        return out

    @staticmethod
    def _extra(extra_keys: Sequence[bytes | None] | None, i: int) -> bytes:
        if extra_keys is None or i >= len(extra_keys):
            return b""
        return _frame_extra(extra_keys[i])
