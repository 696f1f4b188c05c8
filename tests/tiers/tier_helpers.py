"""Real block chains for tier tests: hashed with BlockHasher, KV from a seeded generator."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from hashing import BlockHasher, Namespace
from kvstore.entry import BlockEntry, decode_entry, encode_entry

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def namespace(
    dtype: torch.dtype = torch.float32,
    layers: int = 2,
    kv_heads: int = 2,
    head_dim: int = 8,
    block_size: int = 4,
    salt: str = "",
) -> Namespace:
    return Namespace(
        model_fingerprint="tier-test-model",
        kv_dtype=DTYPE_NAMES[dtype],
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        salt=salt,
    )


class Chain(NamedTuple):
    """The blocks of one prompt: entries[i] is block i; `encoded` uses `codec`."""

    ns: Namespace
    dtype: torch.dtype
    entries: list[BlockEntry]
    encoded: list[bytes]

    @property
    def keys(self) -> list[bytes]:
        return [e.key for e in self.entries]

    @property
    def items(self) -> list[tuple[bytes, bytes]]:
        return list(zip(self.keys, self.encoded, strict=True))

    def decode(self, i: int, data: bytes) -> BlockEntry:
        e = self.entries[i]
        return decode_entry(
            data, namespace=self.ns.root(), key=e.key, digest=e.digest, dtype=self.dtype
        )


def make_chain(
    ns: Namespace,
    num_blocks: int,
    seed: int = 0,
    codec: str = "none",
    hasher: BlockHasher | None = None,
) -> Chain:
    dtype = {v: k for k, v in DTYPE_NAMES.items()}[ns.kv_dtype]
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, size=num_blocks * ns.block_size, dtype=np.uint32)
    hasher = hasher or BlockHasher(ns)
    keys, digests = hasher.hash_blocks(tokens), hasher.digest_blocks(tokens)
    parents = [hasher.root, *keys[:-1]]
    gen = torch.Generator().manual_seed(seed)
    shape = (ns.num_layers, 2, ns.num_kv_heads, ns.block_size, ns.head_dim)
    entries = []
    for i in range(num_blocks):
        kv = torch.randn(shape, generator=gen).to(dtype)
        block_tokens = tokens[i * ns.block_size : (i + 1) * ns.block_size]
        entries.append(BlockEntry(ns.root(), keys[i], digests[i], parents[i], block_tokens, kv))
    return Chain(ns, dtype, entries, [encode_entry(e, codec) for e in entries])


def assert_same_entry(got: BlockEntry, want: BlockEntry) -> None:
    assert got.key == want.key and got.digest == want.digest and got.parent == want.parent
    assert np.array_equal(got.token_ids, want.token_ids)
    assert got.kv.dtype == want.kv.dtype
    assert torch.equal(got.kv, want.kv)


def run_in_threads(work: Callable[[int], None], n: int = 4, timeout_s: float = 60) -> list:
    """Run work(0..n-1) on n threads; returns the exceptions they raised (a thread cannot
    fail the test itself, so the caller asserts the list is empty)."""
    failures: list[BaseException] = []

    def run(t: int) -> None:
        try:
            work(t)
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    return failures


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll until predicate() is true (a condition, never a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.01)
