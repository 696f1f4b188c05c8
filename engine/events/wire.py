"""vLLM's KV event wire format, as vLLM 0.33 (`vllm.distributed.kv_events`) encodes it, so
the consumers written for vLLM (routers, indexers) can index a kvstore replica.

Payload (msgpack): a batch is an array `[ts, events, data_parallel_rank]`; each event is a
map tagged by its `"type"` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) whose fields
with a default value are left out. kvstore's block hashes are its 16-byte lookup keys.

Frames (ZMQ multipart): the PUB socket sends `(topic, seq, payload)`, seq an 8-byte
big-endian count from 0. A replay client (DEALER; a REQ adds the empty frame itself) sends
`(b"", start seq)` to the ROUTER and gets `(b"", topic, seq, payload)` per buffered batch
with seq >= start, then the end marker `(b"", b"", END_SEQ, b"")`.
"""

from __future__ import annotations

import msgspec
import zmq

from kvstore.fleet.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    SPILL_MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def medium_for(device: object) -> str:
    """vLLM's medium of a cache on `device` (a torch.device or its name)."""
    kind = getattr(device, "type", str(device).split(":")[0])
    return MEDIUM_GPU if kind == "cuda" else MEDIUM_CPU


def zmq_host(host: str) -> str:
    """A host as a ZMQ TCP endpoint names it: `*` for every IPv4 address, an IPv6 address in
    brackets (sockets on such endpoints need `ipv6_socket`)."""
    if host == "0.0.0.0":
        return "*"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def ipv6_socket(sock: object, endpoint: str) -> None:
    """Let `sock` use IPv6 when `endpoint` names an IPv6 address."""
    if "[" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=seq < 0)


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


class WireEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event on the wire (tagged by its vLLM class name)."""


class WireBlockStored(WireEvent, tag="BlockStored"):
    """vLLM's fields, in its order (the optional ones are never sent by kvstore; declaring
    them all keeps the encoding byte for byte vLLM's: msgpack sizes a map by its fields)."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class WireBlockRemoved(WireEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class WireAllBlocksCleared(WireEvent, tag="AllBlocksCleared"):
    pass


class WireBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WireBatch)


def _to_wire(event: KVEvent, medium: str) -> WireEvent:
    """`medium`: the publisher's device pool's, for events that name none."""
    if isinstance(event, BlockStored):  # lists of bytes and ints already: no copy
        hashes, parent = event.block_hashes, event.parent_block_hash
        tokens, medium = event.token_ids, event.medium or medium
        return WireBlockStored(hashes, parent, tokens, event.block_size, None, medium, None)
    if isinstance(event, BlockRemoved):
        return WireBlockRemoved(event.block_hashes, event.medium or medium)
    if isinstance(event, AllBlocksCleared):
        return WireAllBlocksCleared()
    raise TypeError(f"not a KV event: {type(event).__name__}")


def _from_wire(event: WireEvent) -> KVEvent:
    """A spill medium is kept; any other (GPU, CPU, none) is the replica's device pool."""
    if isinstance(event, WireBlockStored):
        parent, medium = event.parent_block_hash, _spill(event.medium)
        return BlockStored(event.block_hashes, parent, event.token_ids, event.block_size, medium)
    if isinstance(event, WireBlockRemoved):
        return BlockRemoved(event.block_hashes, _spill(event.medium))
    return AllBlocksCleared()


def _spill(medium: str | None) -> str | None:
    return medium if medium in SPILL_MEDIA else None


def encode_batch(
    ts: float, events: list[KVEvent], medium: str = MEDIUM_CPU, data_parallel_rank: int = 0
) -> bytes:
    """One batch's payload (vLLM's `KVEventBatch`). vLLM's publisher stamps its data-parallel
    rank (0 without data parallelism) on every batch; so does this."""
    wire = [_to_wire(event, medium) for event in events]
    return _encoder.encode(WireBatch(ts, wire, data_parallel_rank))


def decode_wire(payload: bytes) -> WireBatch:
    """The batch as sent, medium included (raises msgspec.DecodeError on a bad payload)."""
    return _decoder.decode(payload)


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """(ts, events) of one payload, as kvstore.fleet.events values."""
    batch = decode_wire(payload)
    return batch.ts, [_from_wire(event) for event in batch.events]
