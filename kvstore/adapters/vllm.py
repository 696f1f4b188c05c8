"""vLLM: kvstore's spill tiers as a secondary tier of the OffloadingConnector.

vLLM offloads GPU blocks to its CPU primary tier; a secondary tier stores chunks of that
CPU buffer (addressed by chunk ids) under `OffloadKey`s (block hash + group index) and
loads them back into it. `KvstoreTier` does so through a `BlockStore`:

- `lookup` is non-blocking: vLLM's `AsyncLookupManager` batches each step's keys per
  request into one `contains` (one round trip per store) on its own thread;
- `submit_store` / `submit_load` queue one job each on the tier's I/O threads: a store job
  encodes its chunks and writes them in one batch, a load job reads its chunks in one batch,
  verifies each and copies it into the primary buffer; `get_finished_jobs` reports them;
- a failing tier (breaker open, Redis down) makes lookups miss and jobs fail, never raises.

Enable it with `--kv-transfer-config` (docs/ADAPTERS.md):
`{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config":
{"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": ..., "secondary_tiers": [{"type":
"KvstoreTier", "module_path": "kvstore.adapters.vllm", "kvstore": {"redis_url": ...}}]}}`.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from hashing import StackNamespace
from kvstore.adapters.blocks import BlockStore, PutBlock, config_from_settings, startup_errors
from kvstore.config import CacheConfig, ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

STACK = "vllm"


def vllm_namespace(config: OffloadingConfig, chunk_bytes: int, tenant: str) -> StackNamespace:
    """The namespace of one engine's chunks: model, dtype and every field that changes a
    chunk's bytes (groups and layers, tokens per hash, blocks per chunk, chunk size,
    parallelism unless the bytes are parallelism-agnostic, the KV cache layout)."""
    layers = json.dumps([list(g.layer_names) for g in config.groups]).encode()
    p = config.parallel
    layout = {
        "groups": [(g.group_id, g.tokens_per_block) for g in config.groups],
        "layers": hashlib.sha256(layers).hexdigest()[:16],
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "chunk_bytes": chunk_bytes,
        "kv_cache_layout": config.kv_cache_layout,
        "canonical": config.canonical_layout,
    }
    if not (p.is_parallelism_agnostic or config.replicated_layout):
        layout["parallel"] = (p.tp_size, p.pp_size, p.pcp_size, p.dcp_size, p.rank)
    text, model = json.dumps(layout, sort_keys=True), config.model
    return StackNamespace(STACK, model.name, text, model.dtype, tenant)


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup front end: one `contains` per request and step, off-thread."""

    def __init__(self, blocks: BlockStore, tier_type: str):
        self._blocks = blocks
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._blocks.contains([bytes(k) for k in keys])


TIER_KEYS = ("kvstore", "io_threads", "locality", "backpressure")  # besides type, module_path


def _tier_config(
    kvstore: Mapping[str, Any] | None,
    io_threads: int,
    locality: str | None,
    unknown: Mapping[str, Any],
) -> tuple[CacheConfig, Locality | None]:
    """The tier entry's settings checked before anything is built; else ConfigError."""
    if unknown:
        name = sorted(unknown)[0]
        raise ConfigError(name, f"is not a key of a KvstoreTier entry; use: {', '.join(TIER_KEYS)}")
    if not isinstance(io_threads, int) or io_threads < 1:
        raise ConfigError("io_threads", f"must be an int >= 1, got {io_threads!r}")
    try:
        where = Locality(locality) if locality is not None else None
    except ValueError:
        names = ", ".join(m.value for m in Locality)
        raise ConfigError("locality", f"must be one of {names}, got {locality!r}") from None
    return config_from_settings(kvstore), where


class KvstoreTier(SecondaryTierManager):
    """A vLLM secondary tier on kvstore's spill tiers (memory, LMDB, Redis, Redis Cluster).

    Tier config keys: `kvstore` (CacheConfig settings, e.g. {"redis_url": ...}; KVSTORE_*
    variables fill the rest, KVSTORE_SECRET included), `io_threads` (default 2),
    `locality` ("LOCAL" or "REMOTE")."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        kvstore: Mapping[str, Any] | None = None,
        io_threads: int = 2,
        locality: str | None = None,
        **unknown: Any,
    ):
        where = "the KvstoreTier entry of --kv-transfer-config's secondary_tiers"
        with startup_errors(STACK, where, "vLLM does not start"):
            config, where_to = _tier_config(kvstore, io_threads, locality, unknown)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = where_to
        chunk = self.block_size_bytes
        namespace = vllm_namespace(offloading_spec.config, chunk, config.tenant_salt)
        self.blocks = BlockStore(config, namespace)
        self._buffer = primary_kv_view.cast("B")  # chunk i: [i * chunk, (i + 1) * chunk)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-vllm")
        self._jobs: set[Future] = set()
        self._jobs_lock = threading.Lock()
        self._finished: queue.SimpleQueue[tuple[JobResult, list[OffloadKey]]] = queue.SimpleQueue()
        self._lookups = _Lookups(self.blocks, tier_type)

    # --- scheduler-thread API ---------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self._store, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(self._load, job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        while not self._finished.empty():
            result, failed = self._finished.get_nowait()
            self._lookups.mark_miss(failed)  # a failed load is not retried as a hit
            results.append(result)
        return results

    def has_pending_work(self) -> bool:
        with self._jobs_lock:
            return bool(self._jobs)

    def drain_jobs(self) -> None:
        with self._jobs_lock:
            jobs = list(self._jobs)
        wait(jobs)

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._pool.shutdown(wait=True)
        self.blocks.close()
        self._buffer.release()  # vLLM unmaps the primary buffer once no view is exported

    # --- I/O threads ------------------------------------------------------------------------

    def _submit(self, run: Any, job: TransferJob) -> None:
        keys, chunk_ids = list(job.keys), [int(c) for c in job.chunk_ids]
        if len(keys) != len(chunk_ids):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys, {len(chunk_ids)} chunk ids")
        future = self._pool.submit(self._run, run, job.job_id, keys, chunk_ids)
        with self._jobs_lock:
            self._jobs.add(future)
        future.add_done_callback(self._job_done)

    def _job_done(self, future: Future) -> None:
        with self._jobs_lock:
            self._jobs.discard(future)

    def _run(self, run: Any, job_id: int, keys: list[OffloadKey], chunk_ids: list[int]) -> None:
        """One job on an I/O thread; its result (and failed keys) to get_finished_jobs."""
        start = time.monotonic()
        try:
            failed = run(keys, chunk_ids)
        except Exception:  # never into vLLM: the job fails, its keys are misses
            failed = keys
        lost = set(failed)
        done = [k for k in keys if k not in lost]
        partial = done if failed and done else None
        nbytes = len(done) * self.block_size_bytes
        result = JobResult(job_id, not failed, partial, time.monotonic() - start, nbytes)
        self._finished.put((result, failed))

    def _chunk(self, chunk_id: int) -> memoryview:
        size = self.block_size_bytes
        return self._buffer[chunk_id * size : (chunk_id + 1) * size]

    def _store(self, keys: list[OffloadKey], chunk_ids: list[int]) -> list[OffloadKey]:
        """Write the chunks in one batch; returns the keys that failed (all or none)."""
        tokens = self._tokens_per_chunk()
        pairs = zip(keys, chunk_ids, strict=True)
        blocks = [PutBlock(bytes(k), self._chunk(c), tokens) for k, c in pairs]
        return [] if self.blocks.put(blocks) else keys

    def _load(self, keys: list[OffloadKey], chunk_ids: list[int]) -> list[OffloadKey]:
        """Read the chunks in one batch into the primary buffer; returns the keys missed."""
        got = self.blocks.get([bytes(k) for k in keys], payload_bytes=self.block_size_bytes)
        failed = []
        for key, chunk_id, block in zip(keys, chunk_ids, got, strict=True):
            if block is None:
                failed.append(key)
            else:
                self._chunk(chunk_id)[:] = block.payload
        return failed

    def _tokens_per_chunk(self) -> int:
        config = self._offloading_spec.config
        return config.cache.tokens_per_hash * config.cache.blocks_per_chunk

    def stats(self) -> dict[str, Any]:
        """kvstore's counters and tier stats for this tier (docs/ADAPTERS.md)."""
        return self.blocks.stats()
