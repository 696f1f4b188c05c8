"""Request traces as chains of block ids, read from and written to two JSONL formats.

Mooncake format (one request a line; block size 512 tokens):
    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}
`timestamp` is the arrival in ms; `hash_ids` has one id per 512-token block of the prompt, the
last one partial; an id names its whole prefix chain (two prompts with equal ids at position k
share their first k+1 blocks).

Token format (one request a line; the block size is chosen when reading):
    {"timestamp": 0.0, "token_ids": [1, 2, 3, ...]}

Both become a `BlockTrace`: every request as the chain of its cacheable blocks, renamed to
dense ids 0..U-1. A request's cacheable blocks are the full blocks of its first L-1 tokens
(the last prompt token is always computed, so no hit can cover it: docs/ARCHITECTURE.md);
a request looks up and inserts exactly those.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import xxhash

from hashing import BlockHasher, Namespace, as_token_array

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "BlockTrace",
    "Request",
    "TraceError",
    "TraceStats",
    "from_chains",
    "from_token_requests",
    "load_trace",
    "read_mooncake",
    "read_token_jsonl",
    "write_mooncake",
    "write_token_jsonl",
]

MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace file or request list is malformed; the message says where and what to fix."""


class Request(NamedTuple):
    """One prompt of a token-level workload."""

    timestamp_ms: float
    token_ids: np.ndarray  # uint32 [L]
    output_len: int = 0  # answer length, when the workload knows it


class TraceStats(NamedTuple):
    requests: int
    block_refs: int
    unique_blocks: int
    mean_input_tokens: float
    infinite_block_hit_rate: float  # share of block references that were seen before


@dataclass(frozen=True, eq=False)
class BlockTrace:
    """Requests as chains of dense block ids (each id names its whole prefix chain)."""

    offsets: np.ndarray  # int64 [R + 1]: request i's blocks are blocks[offsets[i]:offsets[i+1]]
    blocks: np.ndarray  # int64 [offsets[-1]], dense ids 0..U-1
    num_tokens: np.ndarray  # int64 [R], prompt length in tokens
    timestamps: np.ndarray  # float64 [R], arrival in ms
    block_tokens: int  # tokens per block
    name: str = "trace"

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.num_tokens) + 1 or self.offsets[-1] != len(self.blocks):
            raise TraceError(
                "offsets must have one more entry than requests and end at len(blocks)"
            )
        if len(self.timestamps) != len(self.num_tokens):
            raise TraceError("timestamps must have one entry per request")

    @property
    def num_requests(self) -> int:
        return len(self.num_tokens)

    @property
    def num_refs(self) -> int:
        return len(self.blocks)

    @property
    def num_unique(self) -> int:
        return int(self.blocks.max()) + 1 if len(self.blocks) else 0

    def request(self, i: int) -> np.ndarray:
        return self.blocks[self.offsets[i] : self.offsets[i + 1]]

    def parents(self) -> np.ndarray:
        """int64 [U]: each block's parent block id, or -1 for a first block."""
        out = np.full(self.num_unique, -1, dtype=np.int64)
        out[self.blocks] = _prev_blocks(self.offsets, self.blocks)
        return out

    def first_refs(self) -> np.ndarray:
        """bool [num_refs]: whether a reference is the first one of its block."""
        first = np.zeros(len(self.blocks), dtype=bool)
        _, index = np.unique(self.blocks, return_index=True)
        first[index] = True
        return first

    def stats(self) -> TraceStats:
        refs = self.num_refs
        reused = refs - self.num_unique
        return TraceStats(
            self.num_requests,
            refs,
            self.num_unique,
            float(self.num_tokens.mean()) if self.num_requests else 0.0,
            reused / refs if refs else 0.0,
        )


def cacheable_blocks(num_tokens: int, block_tokens: int) -> int:
    """Full blocks of the first L-1 tokens: the most blocks a prompt of L tokens can hit."""
    return max(num_tokens - 1, 0) // block_tokens


def _prev_blocks(offsets: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Each reference's parent (the previous block of its request), -1 for first blocks."""
    prev = np.empty_like(blocks)
    prev[1:] = blocks[:-1]
    prev[offsets[:-1][np.diff(offsets) > 0]] = -1
    return prev


def _check_chains(
    offsets: np.ndarray, blocks: np.ndarray, raw: np.ndarray, where: Sequence[int]
) -> None:
    """Every id must have one parent everywhere it appears (ids name whole prefix chains)."""
    if len(blocks) == 0:
        return
    prev = _prev_blocks(offsets, blocks)
    ids, first = np.unique(blocks, return_index=True)
    first_parent = np.full(int(blocks.max()) + 1, -2, dtype=np.int64)
    first_parent[ids] = prev[first]
    bad = np.flatnonzero(first_parent[blocks] != prev)
    if len(bad):
        req = int(np.searchsorted(offsets, bad[0], side="right")) - 1
        raise TraceError(
            f"line {where[req]}: block id {int(raw[bad[0]])} follows a different parent than "
            "where it first appears; an id must name its whole prefix chain"
        )


def _densify(chains: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lengths = np.array([len(c) for c in chains], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    raw = np.concatenate(chains).astype(np.int64) if chains else np.zeros(0, np.int64)
    # dense ids in order of first appearance, so that traces are easy to read and compare
    _, first, inverse = np.unique(raw, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return offsets, rank[inverse.reshape(-1)], raw


def _iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise TraceError(f"{path}:{lineno}: expected a JSON object per line")
            yield lineno, record


def _field(record: dict[str, Any], name: str, where: str) -> Any:
    if name not in record:
        raise TraceError(f"{where}: missing field {name!r}")
    return record[name]


def _nonneg_int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    return value


def read_mooncake(path: str | Path, name: str | None = None) -> BlockTrace:
    """A Mooncake-format JSONL trace (512-token blocks, `hash_ids`) as a BlockTrace."""
    path = Path(path)
    chains, lengths, times, lines = [], [], [], []
    for lineno, record in _iter_jsonl(path):
        where = f"{path}:{lineno}"
        length = _nonneg_int(_field(record, "input_length", where), "input_length", where)
        ids = _field(record, "hash_ids", where)
        n = cacheable_blocks(length, MOONCAKE_BLOCK_TOKENS)
        if not isinstance(ids, list) or len(ids) < n:
            raise TraceError(f"{where}: input_length {length} needs at least {n} hash_ids")
        for x in ids[:n]:
            _nonneg_int(x, "every hash id", where)
        chains.append(np.asarray(ids[:n], dtype=np.int64))
        lengths.append(length)
        times.append(float(_field(record, "timestamp", where)))
        lines.append(lineno)
    return _build(chains, lengths, times, lines, MOONCAKE_BLOCK_TOKENS, name or path.stem)


def _build(
    chains: list[np.ndarray],
    lengths: list[int],
    times: list[float],
    lines: Sequence[int],
    block_tokens: int,
    name: str,
) -> BlockTrace:
    offsets, blocks, raw = _densify(chains)
    _check_chains(offsets, blocks, raw, lines)
    return BlockTrace(
        offsets,
        blocks,
        np.asarray(lengths, dtype=np.int64),
        np.asarray(times, dtype=np.float64),
        block_tokens,
        name,
    )


def from_chains(
    chains: Sequence[Sequence[int]], block_tokens: int = 1, name: str = "chains"
) -> BlockTrace:
    """A trace from raw block-id chains (each id naming its whole prefix), one request per
    chain, 1 ms apart; each prompt is taken to be one token longer than its blocks."""
    arrays = [np.asarray(c, dtype=np.int64).reshape(-1) for c in chains]
    if any(len(a) and a.min() < 0 for a in arrays):
        raise TraceError("block ids must be >= 0")
    lengths = [len(a) * block_tokens + 1 for a in arrays]
    times = [float(i) for i in range(len(arrays))]
    return _build(arrays, lengths, times, range(1, len(arrays) + 1), block_tokens, name)


def bench_hasher(block_size: int) -> BlockHasher:
    """The block hasher of token-level traces (a fixed bench namespace)."""
    return BlockHasher(Namespace("bench-hitrate", "float16", 1, 1, 1, block_size))


def from_token_requests(
    requests: Iterable[Request], block_size: int = 16, name: str = "trace"
) -> BlockTrace:
    """Hash each prompt's cacheable blocks (chained keys) and rename the keys to dense ids."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise TraceError(f"block_size must be a positive int, got {block_size!r}")
    hasher, dense = bench_hasher(block_size), {}
    chains, lengths, times = [], [], []
    for request in requests:
        tokens = as_token_array(request.token_ids)
        n = cacheable_blocks(len(tokens), block_size)
        keys = hasher.hash_blocks(tokens[: n * block_size])
        chains.append(np.array([dense.setdefault(k, len(dense)) for k in keys], dtype=np.int64))
        lengths.append(len(tokens))
        times.append(float(request.timestamp_ms))
    return _build(chains, lengths, times, range(1, len(chains) + 1), block_size, name)


def read_token_requests(path: str | Path) -> list[Request]:
    path = Path(path)
    out = []
    for lineno, record in _iter_jsonl(path):
        where = f"{path}:{lineno}"
        tokens = _field(record, "token_ids", where)
        if not isinstance(tokens, list):
            raise TraceError(f"{where}: token_ids must be a list of token ids")
        try:
            array = as_token_array(tokens)
        except (ValueError, TypeError) as exc:
            raise TraceError(f"{where}: {exc}") from None
        out.append(Request(float(_field(record, "timestamp", where)), array))
    return out


def read_token_jsonl(path: str | Path, block_size: int = 16, name: str | None = None) -> BlockTrace:
    """A token-format JSONL trace as a BlockTrace of `block_size`-token blocks."""
    path = Path(path)
    return from_token_requests(read_token_requests(path), block_size, name or path.stem)


def load_trace(path: str | Path, block_size: int = 16) -> BlockTrace:
    """Either format, told apart by the first record's fields."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    for _, record in _iter_jsonl(path):
        if "hash_ids" in record:
            return read_mooncake(path)
        if "token_ids" in record:
            return read_token_jsonl(path, block_size)
        raise TraceError(f"{path}: first record has neither 'hash_ids' nor 'token_ids'")
    raise TraceError(f"{path}: the trace is empty")


def write_token_jsonl(path: str | Path, requests: Iterable[Request]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            record = {"timestamp": round(r.timestamp_ms, 3), "token_ids": r.token_ids.tolist()}
            f.write(json.dumps(record, separators=(",", ":")) + "\n")


def mooncake_records(requests: Iterable[Request]) -> list[dict[str, Any]]:
    """Mooncake records of token requests: one hash id per 512-token block, the last partial,
    ids numbered by first appearance (as Mooncake remaps them)."""
    hasher, dense, out = bench_hasher(MOONCAKE_BLOCK_TOKENS), {}, []
    for r in requests:
        tokens = as_token_array(r.token_ids)
        keys = hasher.hash_blocks(tokens)
        tail = len(tokens) % MOONCAKE_BLOCK_TOKENS
        if tail:  # the partial last block: its tokens chained on the last full block's key
            parent = keys[-1] if keys else hasher.root
            keys.append(b"partial" + xxhash.xxh3_128_digest(parent + tokens[-tail:].tobytes()))
        out.append(
            {
                "timestamp": round(r.timestamp_ms),
                "input_length": len(tokens),
                "output_length": int(r.output_len),
                "hash_ids": [dense.setdefault(k, len(dense)) for k in keys],
            }
        )
    return out


def write_mooncake(path: str | Path, requests: Iterable[Request]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in mooncake_records(requests):
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
