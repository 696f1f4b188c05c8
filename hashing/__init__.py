"""Block hashing: namespace roots and chained per-block keys. No torch, no I/O.

Two chains are computed over the same blocks:
- the lookup key (`BlockHash`, 16 bytes): xxh3_128(parent_key || token ids as LE uint32
  [|| framed extra key]), rooted at `Namespace.root()`;
- the verification digest (16 bytes): keyed BLAKE2b-128 chained the same way, rooted at
  `Namespace.verify_root(secret)`. Spill-tier entries carry it so that a collision of the
  lookup key alone is a miss, never wrong KV.
"""

from __future__ import annotations

from hashing.blocks import (
    DEFAULT_KEY_ID,
    DEFAULT_SECRET,
    HASH_BYTES,
    KEY_ID_BYTES,
    BlockHash,
    BlockHasher,
    InvalidTokens,
    as_token_array,
    key_id,
    num_full_blocks,
)
from hashing.namespace import (
    FORMAT_VERSION,
    KV_CACHE_DTYPES,
    InvalidNamespace,
    Namespace,
    combine_salts,
    validate_salt,
)
from hashing.stack import StackHasher, StackNamespace

__all__ = [
    "DEFAULT_KEY_ID",
    "DEFAULT_SECRET",
    "FORMAT_VERSION",
    "HASH_BYTES",
    "KEY_ID_BYTES",
    "KV_CACHE_DTYPES",
    "BlockHash",
    "BlockHasher",
    "InvalidNamespace",
    "InvalidTokens",
    "Namespace",
    "StackHasher",
    "StackNamespace",
    "as_token_array",
    "combine_salts",
    "key_id",
    "num_full_blocks",
    "validate_salt",
]
