"""Scopes: what a request salt sees of a cache's namespace, made once per salt and kept.

A request salt (a per-request `cache_salt`, e.g. a tenant's) narrows the namespace: its
blocks hash differently, so only requests with the same salt can share them. A `Scope`
holds that salt's hasher and the namespace root its tier entries carry, and for entries of a
fixed size the exact entry it reads and writes (`ExpectedEntry`, the fast verify path).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from hashing import BlockHash, BlockHasher, Namespace, combine_salts
from kvstore.config import CacheConfig
from kvstore.entry import ExpectedEntry
from kvstore.entry.quant import QUANT_DTYPES
from kvstore.layout import KVLayout

MAX_SCOPES = 4096  # request salts whose scopes are kept


class Scope(NamedTuple):
    """One request salt's view of the namespace."""

    cache_salt: str
    hasher: BlockHasher
    root: bytes  # Namespace.root(): the namespace field of its tier entries
    # the entries it writes when a pool block is their payload as it is (codec "none", or a
    # quantized pool's codec): fast verify and encode
    expected: ExpectedEntry | None
    # the entries of a quantized codec an unquantized pool reads: fast verify, dequantized
    dequantized: ExpectedEntry | None = None

    def keys(self, tokens: np.ndarray, known: Sequence[BlockHash] = ()) -> list[BlockHash]:
        """Lookup keys of the full blocks of `tokens`; the leading `known` keys (of a lookup)
        are reused and the chain continues from them."""
        num_blocks = len(tokens) // self.hasher.block_size
        known = list(known[:num_blocks])
        if not known:
            return self.hasher.hash_blocks(tokens)
        bs = self.hasher.block_size
        more = self.hasher.hash_blocks(
            tokens[: num_blocks * bs], parent=known[-1], start_block=len(known)
        )
        return known + more


class Scopes:
    """The scopes of one cache by request salt (LRU, bounded); thread-safe."""

    def __init__(self, config: CacheConfig, namespace: Namespace, with_entries: bool):
        """`with_entries`: the cache has spill tiers (scopes then carry their entry)."""
        self.config, self.namespace = config, namespace
        self.layout = KVLayout.of(namespace)
        self.with_entries = with_entries
        self._scopes: OrderedDict[str, Scope] = OrderedDict()
        self._lock = threading.Lock()
        self.default = self._make("")

    def get(self, cache_salt: str = "") -> Scope:
        if not cache_salt:
            return self.default
        with self._lock:
            scope = self._scopes.pop(cache_salt, None) or self._make(cache_salt)
            self._scopes[cache_salt] = scope
            if len(self._scopes) > MAX_SCOPES:
                self._scopes.popitem(last=False)
            return scope

    def _make(self, salt: str) -> Scope:
        ns = self.namespace
        if salt:
            ns = ns.with_salt(combine_salts(ns.salt, salt))
        hasher = BlockHasher(ns, self.config.secret_bytes, self.config.key_bytes)
        root, template = ns.root(), None
        codec = self.config.entry_codec  # a quantized pool's blocks are its entries' payloads
        if self.with_entries and codec in ("none", *QUANT_DTYPES):  # entries of a fixed size
            n = self.config.chunk_blocks
            shape = self.layout.entry_shape(n)
            template = ExpectedEntry(root, self.layout.dtype, shape, n, hasher.key_id, codec)
        if codec == "none" or self.layout.quant is not None:  # a pool block is the payload
            return Scope(salt, hasher, root, expected=template)
        return Scope(salt, hasher, root, expected=None, dequantized=template)
