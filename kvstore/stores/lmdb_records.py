"""LMDB record helpers behind `LmdbStore` (kvstore/stores/lmdb.py, whose docstring gives the
sub-dbs): each works inside the caller's transaction, on full keys (namespace id + key)."""

from __future__ import annotations

import lmdb

from kvstore.stores.lmdb_env import SharedEnv


def advance(shared: SharedEnv) -> None:
    """Commit one tiny transaction: pages freed by transaction N are reusable from N + 2."""
    with shared.env.begin(write=True, db=shared.meta) as txn:
        generation = int.from_bytes(txn.get(b"generation", b""), "big") + 1
        txn.put(b"generation", generation.to_bytes(8, "big"))


def append(txn: lmdb.Transaction, shared: SharedEnv, key: bytes) -> None:
    """Give `key` the next insertion sequence (the back of the FIFO)."""
    cursor = txn.cursor(db=shared.order)
    seq = int.from_bytes(cursor.key(), "big") + 1 if cursor.last() else 0
    seq_key = seq.to_bytes(8, "big")
    txn.put(seq_key, key, db=shared.order, append=True)
    txn.put(key, seq_key, db=shared.seq)


def insert(txn: lmdb.Transaction, shared: SharedEnv, batch: list[tuple[bytes, bytes]]) -> int:
    cursor = txn.cursor(db=shared.order)
    seq = int.from_bytes(cursor.key(), "big") + 1 if cursor.last() else 0
    written = 0
    for key, value in batch:
        if not txn.put(key, value, db=shared.blocks, overwrite=False):
            continue  # already present
        seq_key = seq.to_bytes(8, "big")
        seq += 1
        txn.put(seq_key, key, db=shared.order, append=True)
        txn.put(key, seq_key, db=shared.seq)
        written += 1
    return written


def remove(txn: lmdb.Transaction, shared: SharedEnv, full_key: bytes) -> int:
    seq_key = txn.pop(full_key, db=shared.seq)
    if seq_key is not None:
        txn.delete(seq_key, db=shared.order)
    txn.delete(full_key, db=shared.expiry)
    return int(txn.delete(full_key, db=shared.blocks))
