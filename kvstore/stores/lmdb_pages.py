"""LMDB page arithmetic behind `LmdbStore`'s writes (the pages an environment has and uses,
what an entry and a batch cost in pages, and batches that fit a budget), and its expiry
records' encoding."""

from __future__ import annotations

from collections.abc import Iterator

import lmdb

from kvstore.stores.lmdb_env import SharedEnv


def pages(shared: SharedEnv) -> tuple[int, int]:
    """(page size, map size in pages)."""
    psize = shared.env.stat()["psize"]
    return psize, shared.env.info()["map_size"] // psize


def page_counts(txn: lmdb.Transaction, shared: SharedEnv) -> tuple[int, int]:
    """(live pages, of which branch and leaf pages: the ones a write copies)."""
    live = tree = 0
    for db in shared.all_dbs:
        st = txn.stat(db)
        tree += st["branch_pages"] + st["leaf_pages"]
        live += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
    return live, tree


def used_pages(txn: lmdb.Transaction, shared: SharedEnv) -> int:
    return page_counts(txn, shared)[0]


def tree_pages(shared: SharedEnv) -> int:
    with shared.env.begin() as txn:
        return page_counts(txn, shared)[1]


def expiry_ms(value: bytes | None) -> int:
    """An expiry record's milliseconds (0: none)."""
    return 0 if value is None else int.from_bytes(value, "big")


_NODE_HEADER = 8  # bytes before a key in a leaf node
_PAGE_HEADER = 16
_ORDER_SEQ_BYTES = 2 * (_NODE_HEADER + 8 + 24)  # its "order" and "seq" records


def data_pages(key_bytes: int, value_bytes: int, psize: int) -> float:
    """Pages an entry adds: a leaf node (a share of a page) or, when the node is over LMDB's
    node limit (a little under half a page), an overflow run; plus its "order" and "seq"
    records."""
    node = _NODE_HEADER + key_bytes + value_bytes
    if node > _node_max(psize):
        return -(-(value_bytes + _PAGE_HEADER) // psize) + _ORDER_SEQ_BYTES / psize
    return (node + _ORDER_SEQ_BYTES) / psize


def _node_max(psize: int) -> int:
    return (((psize - _PAGE_HEADER) // 2) & ~1) - 2  # measured: 2038 bytes at 4 KiB pages


def reserve(num_entries: int, tree_pages: int) -> int:
    """Pages copy-on-write needs beyond the data: the leaves and branches an insert of
    `num_entries` copies (about one in "blocks" and one in "seq" per entry, random keys; at
    most the whole tree), twice: the previous commit's replaced pages are not reusable yet."""
    return 2 * min(2 * num_entries + 6, tree_pages + 3)


def batches(
    items: list[tuple[tuple[bytes, bytes], float]], budget: float, tree_pages: int
) -> Iterator[tuple[list[tuple[bytes, bytes]], float]]:
    """Split (item, data pages) pairs into batches whose data + reserve fit `budget` pages
    (a batch holds at least one item), yielding each batch and its data pages."""
    batch: list[tuple[bytes, bytes]] = []
    data = 0.0
    for item, pages in items:
        if batch and data + pages + reserve(len(batch) + 1, tree_pages) > budget:
            yield batch, data
            batch, data = [], 0.0
        batch.append(item)
        data += pages
    if batch:
        yield batch, data
