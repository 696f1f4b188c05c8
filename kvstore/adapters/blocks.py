"""BlockStore: a serving stack's blocks in kvstore's spill tiers, as verified entries.

Every adapter (vLLM, LMCache, SGLang) maps its stack's keys and buffers onto one
`BlockStore`: keys are the stack's own block keys (bytes), values its blocks' raw bytes.
Each block is stored as a stack entry (`kvstore.entry.stack`) under a `StackNamespace`, so
a read proves the namespace, the secret, the exact stack key (keyed digest) and the
checksum; anything else reads as a miss and is counted, and only a damaged entry is deleted
(`kvstore.tiers.rejects`: another secret's entries are kept).

Every call is one round trip per store, whatever the batch: reads ask the stores fastest
first, each only for what the faster ones missed (and fill the faster ones with what a
slower one had); writes go to every store whose write policy is not "off". No call raises
on a store failure: the stores' breakers and error counting make a failing tier a miss.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from typing import Any, NamedTuple

from hashing import StackHasher, StackNamespace
from kvstore.config import CacheConfig, ConfigError
from kvstore.config.settings import load_config
from kvstore.entry import EntryError
from kvstore.entry.stack import STACK_CODECS, decode_stack_entry, encode_stack_entry
from kvstore.metrics import CacheMetrics
from kvstore.stores import SpillStore, make_stores
from kvstore.tiers.rejects import Rejections

SETTINGS_KEY = "kvstore"  # the stacks' config key that holds kvstore's settings
log = logging.getLogger("kvstore.adapters")


class Block(NamedTuple):
    """A verified block: its raw bytes (read-only), the stack's metadata, where from."""

    payload: memoryview
    meta: bytes
    num_tokens: int
    tier: str


class PutBlock(NamedTuple):
    """One block to write: the stack's key, its raw bytes, tokens covered, its metadata."""

    stack_key: bytes
    payload: bytes | memoryview
    num_tokens: int = 0
    meta: bytes = b""


# The CacheConfig fields an adapter uses (docs/ADAPTERS.md): its tiers, their failure
# handling, the entries' secret, tenant and codec, and the write policies.
ADAPTER_SETTINGS = (
    "memory_cache_gb", "lmdb_dir", "lmdb_map_size_gb", "redis_url", "redis_ttl_s",
    "lookup_deadline_ms", "breaker_failures", "breaker_cooldown_s", "secret", "tenant_salt",
    "codec", "memory_write_policy", "lmdb_write_policy", "redis_write_policy",
)  # fmt: skip


def config_from_settings(
    settings: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> CacheConfig:
    """The CacheConfig of an adapter: `settings` (`ADAPTER_SETTINGS`; strings are converted)
    over KVSTORE_* variables and KVSTORE_CONFIG's TOML. Raises ConfigError."""
    settings = dict(settings or {})
    unknown = sorted(set(settings) - set(ADAPTER_SETTINGS))
    if unknown:
        raise ConfigError(unknown[0], _unknown_setting(unknown[0]))
    config = load_config(env=os.environ if env is None else env, overrides=settings)
    if config.codec not in STACK_CODECS:
        raise ConfigError("codec", f"adapters store raw bytes: use one of {STACK_CODECS}")
    if not config.has_tiers:
        raise ConfigError("redis_url", "set at least one of memory_cache_gb, lmdb_dir, redis_url")
    return config


@contextlib.contextmanager
def startup_errors(stack: str, where: str, consequence: str) -> Iterator[None]:
    """An adapter's start-up: a ConfigError is logged at ERROR with what to fix and what the
    stack does about it (LMCache catches it and runs on: the log still says why), then
    raised."""
    try:
        yield
    except ConfigError as e:
        log.error(
            "kvstore's %s adapter cannot start: %s. Fix %s (docs/ADAPTERS.md); %s.",
            stack, e, where, consequence,
        )  # fmt: skip
        raise


def _unknown_setting(name: str) -> str:
    close = difflib.get_close_matches(name, ADAPTER_SETTINGS, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    what = "does nothing in an adapter" if name in CacheConfig.field_names() else "is unknown"
    return f"this kvstore setting {what}; {hint}an adapter takes: {', '.join(ADAPTER_SETTINGS)}"


def settings_of(mapping: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """The `kvstore` settings mapping inside a stack's config mapping (may be absent)."""
    settings = (mapping or {}).get(SETTINGS_KEY, {})
    if not isinstance(settings, Mapping):
        raise ConfigError(SETTINGS_KEY, f"{where}: must be a mapping of kvstore settings")
    return dict(settings)


def _write_policy(config: CacheConfig, tier: str) -> str:
    return getattr(config, f"{tier}_write_policy", "write-through")


class BlockStore:
    """One stack namespace's blocks in the configured spill tiers (thread-safe)."""

    def __init__(
        self,
        config: CacheConfig,
        namespace: StackNamespace,
        stores: Sequence[SpillStore] | None = None,
        metrics: CacheMetrics | None = None,
    ):
        self.config, self.namespace = config, namespace
        self.hasher = StackHasher(namespace, config.secret_bytes)
        self.root = self.hasher.root
        self.stores = list(stores) if stores is not None else make_stores(config, namespace.id)
        self.metrics = metrics if metrics is not None else CacheMetrics()
        self.rejections = Rejections(self.metrics)
        self._writable = [s for s in self.stores if _write_policy(config, s.name) != "off"]
        self._write_lock = threading.Lock()  # dropped-write deltas are per call

    @property
    def stack(self) -> str:
        return self.namespace.stack

    def keys(self, stack_keys: Sequence[bytes]) -> list[bytes]:
        return [self.hasher.key(k) for k in stack_keys]

    # --- reads ------------------------------------------------------------------------------

    def contains(self, stack_keys: Sequence[bytes]) -> list[bool]:
        """Whether each block is in some tier (a promise: it may fail verification later)."""
        keys, found = self.keys(stack_keys), [False] * len(stack_keys)
        self.metrics.inc("adapter_lookups_blocks_total", len(keys), stack=self.stack)
        for store in self.stores:
            todo = [i for i, hit in enumerate(found) if not hit]
            if not todo:
                break
            for i, hit in zip(todo, store.contains_many([keys[i] for i in todo]), strict=True):
                found[i] = hit
        return found

    def count_prefix(self, stack_keys: Sequence[bytes]) -> int:
        """How many leading blocks are in the tiers, each store asked for the rest."""
        keys, n = self.keys(stack_keys), 0
        self.metrics.inc("adapter_lookups_blocks_total", len(keys), stack=self.stack)
        for store in self.stores:
            if n == len(keys):
                break
            n += store.count_prefix(keys[n:])
        return n

    def get(
        self, stack_keys: Sequence[bytes], payload_bytes: int | None = None
    ) -> list[Block | None]:
        """The verified blocks, None where no tier has a valid one. `payload_bytes`: the size
        every block must have (an entry of another size is rejected)."""
        keys, out = self.keys(stack_keys), [None] * len(stack_keys)
        self.metrics.inc("adapter_reads_blocks_total", len(keys), stack=self.stack)
        for rank, store in enumerate(self.stores):
            todo = [i for i, block in enumerate(out) if block is None]
            if not todo:
                break
            values = store.get_many([keys[i] for i in todo])
            found = self._verify(store, stack_keys, keys, todo, values, payload_bytes, out)
            self._fill_faster(rank, found)
        return out

    def _verify(
        self,
        store: SpillStore,
        stack_keys: Sequence[bytes],
        keys: list[bytes],
        todo: list[int],
        values: list[bytes | None],
        payload_bytes: int | None,
        out: list[Block | None],
    ) -> list[tuple[bytes, bytes]]:
        """Fill `out` with the blocks of `values` that verify; returns (key, entry) of those."""
        found, failures = [], []
        for i, value in zip(todo, values, strict=True):
            if value is None:
                continue
            block = self._decode(store, value, stack_keys[i], keys[i], payload_bytes, failures)
            if block is not None:
                out[i] = block
                found.append((keys[i], value))
        self.rejections.record(store, failures)
        if found:
            n = len(found)
            self.metrics.inc("adapter_hits_blocks_total", n, stack=self.stack, tier=store.name)
        return found

    def _decode(
        self,
        store: SpillStore,
        value: bytes,
        stack_key: bytes,
        key: bytes,
        payload_bytes: int | None,
        failures: list[tuple[bytes, EntryError]],
    ) -> Block | None:
        try:
            entry = decode_stack_entry(
                value,
                namespace=self.root,
                key=key,
                digest=self.hasher.digest(stack_key),
                payload_bytes=payload_bytes,
                key_id=self.hasher.key_id,
            )
        except EntryError as e:
            failures.append((key, e))
            return None
        return Block(entry.payload, entry.meta, entry.num_tokens, store.name)

    def _fill_faster(self, rank: int, found: list[tuple[bytes, bytes]]) -> None:
        """Blocks a slower store had go to the faster writable stores (verified bytes)."""
        faster = [s for s in self.stores[:rank] if s in self._writable]
        if found and faster:
            self._write(faster, found)

    # --- writes -----------------------------------------------------------------------------

    def put(self, blocks: Sequence[PutBlock]) -> bool:
        """Encode each block once and write the batch to every writable store, one round
        trip each. True if some store took the whole batch (written or already there)."""
        if not blocks:
            return True
        items = [(self.hasher.key(b.stack_key), self._encode(b)) for b in blocks]
        return self._write(self._writable, items)

    def _encode(self, block: PutBlock) -> bytes:
        return encode_stack_entry(
            self.root,
            self.hasher.key(block.stack_key),
            self.hasher.digest(block.stack_key),
            block.payload,
            num_tokens=block.num_tokens,
            meta=block.meta,
            codec=self.config.codec,
            key_id=self.hasher.key_id,
        )

    def _write(self, stores: Sequence[SpillStore], items: list[tuple[bytes, bytes]]) -> bool:
        ok = False
        with self._write_lock:
            for store in stores:
                before = store.counters()["dropped_writes"]
                written = store.put_many(items)
                dropped = store.counters()["dropped_writes"] - before
                self._count_write(store.name, written, dropped)
                ok = ok or not dropped
        return ok

    def _count_write(self, tier: str, written: int, dropped: int) -> None:
        if written:
            self.metrics.inc("adapter_writes_blocks_total", written, stack=self.stack, tier=tier)
        if dropped:
            name = "adapter_dropped_writes_blocks_total"
            self.metrics.inc(name, dropped, stack=self.stack, tier=tier)

    def delete(self, stack_keys: Sequence[bytes]) -> int:
        """Remove these blocks from every tier; returns how many entries were removed."""
        keys = self.keys(stack_keys)
        return sum(store.delete(keys) for store in self.stores)

    # --- state ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """{"namespace": id, "metrics": CacheMetrics snapshot, "tiers": per-store stats};
        the snapshot's `hit_rate` is blocks read and verified over blocks asked for."""
        tiers = {store.name: asdict(store.stats()) for store in self.stores}
        metrics = self.metrics.snapshot()
        reads = self.metrics.get("adapter_reads_blocks_total", stack=self.stack)
        hits = metrics["counters"].get("adapter_hits_blocks_total", {})
        found = sum(n for (stack, _), n in hits.items() if stack == self.stack)
        metrics["hit_rate"] = found / reads if reads else 0.0
        return {"namespace": self.namespace.id, "metrics": metrics, "tiers": tiers}

    def clear(self) -> int:
        """Remove this namespace's blocks from every tier (the memory tier: all of it)."""
        return sum(store.clear() for store in self.stores)

    def close(self) -> None:
        for store in self.stores:
            store.close()
