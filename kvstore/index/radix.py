"""RadixIndex: longest-prefix match over chained block hashes, with locks and leaf eviction.

The tree is path-compressed: a node holds a run of consecutive blocks, stored compactly as one
bytes object of keys (16 bytes a block), one bytes object of token ids (little-endian uint32,
block_size a block) and one int64 array of block ids. A node's children are keyed by their
first block key. Matching compares keys and token ids run by run with bytes slices
(match.py), so a hit costs a few C-level comparisons per node, not a Python loop per block or
token.

Invariants (checked by `check_integrity`, in integrity.py):
- every non-root node holds >= 1 block; `start` = blocks before it on its path;
- `ref_cnt` = direct locks on the node + sum of its children's `ref_cnt` (locks count on the
  node and every ancestor), so a locked node's whole path is locked;
- a node is evictable iff it is not the root, has no children and ref_cnt == 0; only
  evictable nodes lose blocks, so a parent never goes before its children;
- a key hit alone is never trusted: a block matches only if its token ids match too;
- counts, locks' evictable totals and policy sizes count held blocks: a hole (`punch`) keeps
  its key and tokens, so paths through it match, but holds no K/V and frees nothing.

The index owns the bookkeeping (node table, block counts, policy, events); the concepts it
composes live beside it: the node, its cuts and its events (tree.py), comparing a query with
runs (match.py), holes (holes.py), reading paths back (paths.py) and the consistency checks
(integrity.py).

Not thread-safe: the owner (PrefixCache) serializes calls.
"""

from __future__ import annotations

import itertools
from array import array
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from hashing import HASH_BYTES
from kvstore.fleet.events import BlockStored, EventSink
from kvstore.index import paths
from kvstore.index.holes import fill_holes, punch_run, punch_spans, punchable_ids
from kvstore.index.integrity import check_counts, check_tree
from kvstore.index.match import num_matching, pack_query
from kvstore.index.policies import IntegrityError, Policy, as_policy
from kvstore.index.tree import (
    HOLE,
    MatchResult,
    TreeNode,
    cut_tail,
    removed_event,
    run_tag,
    snapshot_events,
    split_run,
    stored_event,
)

__all__ = ["IntegrityError", "MatchResult", "RadixIndex", "TreeNode"]

EvictCallback = Callable[["TreeNode", int, list[int]], None]


class RadixIndex:
    """Radix tree over chained block hashes mapping cached prefixes to block ids.

    Recency is block-exact: a hit or an insert refreshes only the blocks it used. When a hit
    ends inside a node's run, the run is split there: the matched blocks become a node of
    their own (`last_node`, the hit's recency; locking it locks exactly them) and the rest a
    child keeping the run's earlier recency, locks and policy history. A split emits no
    event (every block stays cached). `peek_prefix` records nothing, so it never splits.
    """

    def __init__(
        self, block_size: int, policy: Policy | str = "lru", events: EventSink | None = None
    ):
        """`events` gets every block stored and removed (kvstore.fleet.events), in order."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.policy = as_policy(policy)
        self.events = events
        self.root = TreeNode(0, None, 0, b"", b"", array("q"))
        self._nodes: dict[int, TreeNode] = {}  # node id -> node, root excluded
        self._next_id = itertools.count(1)
        self._num_cached = 0
        self._num_evictable = 0  # blocks in nodes with ref_cnt == 0
        self._token_bytes = 4 * block_size

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    # --- lookup and insert -----------------------------------------------------------------
    def match_prefix(self, keys: Sequence[bytes], token_ids: np.ndarray) -> MatchResult:
        """Longest cached prefix of the blocks `keys` (token ids cover at least those blocks).

        Records a hit on every matched block: a run the hit ends inside is split there (see
        the class docstring).
        """
        return self._match(keys, token_ids, record=True)

    def cut_path(self, keys: Sequence[bytes], token_ids: np.ndarray) -> list[TreeNode]:
        """The nodes holding the cached prefix of `keys`, root excluded, root-first; a run the
        prefix ends inside is split there (so the last node ends with it). Records no hit."""
        node = self._match(keys, token_ids, record=False, split=True).last_node
        return [] if node is self.root else self._path(node)

    def split(self, node: TreeNode, k: int) -> TreeNode:
        """Cut `node`'s run after k blocks (0 < k < its blocks); returns the head (the first
        k blocks, now `node`'s parent)."""
        if not 0 < k < node.num_blocks:
            raise ValueError(f"cannot split {node!r} after {k} blocks")
        return self._split(node, k)

    def peek_prefix(self, keys: Sequence[bytes], token_ids: np.ndarray) -> MatchResult:
        """`match_prefix` that records nothing: no policy call, no change of any state (a
        probe, e.g. a scheduler asking what a waiting prompt would find cached)."""
        return self._match(keys, token_ids, record=False)

    def _match(
        self, keys: Sequence[bytes], token_ids: np.ndarray, record: bool, split: bool = False
    ) -> MatchResult:
        n, joined, tokens = pack_query(keys, token_ids, self.block_size)
        node, pos, ids, tw = self.root, 0, [], self._token_bytes
        while pos < n:
            child = node.children.get(keys[pos])
            if child is None:
                break
            k = num_matching(child, joined, tokens, pos, n, tw)
            if k == 0:  # a key hit with different tokens is a miss
                break
            ids += child.ids(0, k)
            partial = k < child.num_blocks
            if partial and (record or split):  # the unused tail keeps its recency
                child = self._split(child, k)
            if record:
                self.policy.access(child.id)
            node, pos = child, pos + k
            if partial:
                break
        return MatchResult(pos, ids, node)

    def insert(
        self,
        keys: Sequence[bytes],
        token_ids: np.ndarray,
        block_ids: Sequence[int | None],
        filled: list[tuple[str, int]] | None = None,
        owner: str = "",
    ) -> list[int]:
        """Cache blocks 0..n-1 of a prompt (from the root); returns the caller's block ids the
        index did not keep, for the caller to free. A new run's blocks are `owner`'s
        (`TreeNode.owner`).

        Positions already cached keep the index's block: the caller's id there is returned
        unless it is that same id. If a block's key hits a cached block with different token
        ids (a lookup-key collision), that block and the rest cannot be stored and their ids
        are returned too. A None id is a block the caller does not hold; a hole (`punch`)
        takes the caller's block there, and `filled` (if given) gets (its run's owner, id).
        """
        n, joined, tokens = pack_query(keys, token_ids, self.block_size)
        ids = [None if b is None else int(b) for b in block_ids]
        if len(ids) != n:
            raise ValueError(f"got {len(ids)} block ids for {n} keys; pass one per key")
        node, pos, unkept, tw = self.root, 0, [], self._token_bytes
        while pos < n:
            child = node.children.get(keys[pos])
            if child is None:
                self._add_leaf(node, joined, tokens, ids, pos, n, owner)
                break
            k = num_matching(child, joined, tokens, pos, n, tw)
            if k == 0:  # same key, other tokens (a lookup-key collision): cannot branch
                unkept += [b for b in ids[pos:] if b is not None]
                break
            if k < child.num_blocks:  # the prompt ends or diverges inside this run
                child = self._split(child, k)  # the unused tail keeps its recency
            unkept += self._merge(child, ids[pos : pos + k], filled)
            self.policy.touch(child.id)
            node, pos = child, pos + k
        return unkept

    def _merge(
        self, node: TreeNode, ids: list[int | None], filled: list[tuple[str, int]] | None
    ) -> list[int]:
        """Blocks ids[i] the caller holds for the node's matched block i: a hole takes the
        caller's block (the index keeps it, and `filled` gets it, with the run's owner);
        the caller's other ids are returned (unkept)."""
        if node.num_held == node.num_blocks and None not in ids:
            return [b for a, b in zip(node.block_ids, ids, strict=False) if a != b]
        unkept, fills = fill_holes(node, ids)
        self._recount(node, len(fills))
        if filled is not None:
            filled += [(node.owner, b) for b in fills]
        return unkept

    def _recount(self, node: TreeNode, delta: int) -> None:
        """`node` holds `delta` more blocks (fewer if negative)."""
        if delta:
            node.num_held += delta
            self._num_cached += delta
            if node.ref_cnt == 0:
                self._num_evictable += delta
            self.policy.resize(node.id, node.num_held)

    def _add_leaf(
        self,
        parent: TreeNode,
        keys: bytes,
        tokens: bytes,
        ids: list[int | None],
        pos: int,
        n: int,
        owner: str,
    ) -> None:
        kw, tw = HASH_BYTES, self._token_bytes
        leaf = TreeNode(
            next(self._next_id),
            parent,
            parent.start + parent.num_blocks,
            keys[pos * kw : n * kw],
            tokens[pos * tw : n * tw],
            array("q", [HOLE if b is None else b for b in ids[pos:n]]),
            owner,
        )
        parent.children[leaf.key(0)] = leaf
        self._nodes[leaf.id] = leaf
        self.policy.insert(leaf.id, leaf.num_held, tag=run_tag(leaf.keys))
        self._num_cached += leaf.num_held
        self._num_evictable += leaf.num_held
        self._sync(parent)
        self._sync(leaf)
        if self.events is not None:
            self.events.emit(stored_event(leaf, self.block_size))

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Cut `node` after k blocks; a new parent takes blocks [:k] and node keeps the rest
        (so handles to `node` stay valid). The new parent inherits node's ref_cnt and policy
        history; counts do not change, and no event is emitted (every block stays cached)."""
        head = split_run(node, k, next(self._next_id), self._token_bytes)
        self._nodes[head.id] = head
        self.policy.insert(head.id, head.num_held, tag=run_tag(head.keys), like=node.id)
        self.policy.resize(node.id, node.num_held)
        return head

    # --- locks -------------------------------------------------------------------------------
    def _check_attached(self, node: TreeNode) -> None:
        if node is not self.root and self._nodes.get(node.id) is not node:
            raise ValueError(f"{node!r} is not in this index (evicted, or from another index)")

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (ref_cnt += 1 along the path)."""
        self._check_attached(node)
        walk: TreeNode | None = node
        while walk is not None:
            if walk.ref_cnt == 0:
                self._num_evictable -= walk.num_held
            walk.ref_cnt += 1
            walk = walk.parent
        self._sync(node)

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`."""
        self._check_attached(node)
        if node.ref_cnt <= 0:
            raise ValueError(f"unlock of {node!r}: it is not locked (ref_cnt would go negative)")
        walk: TreeNode | None = node
        while walk is not None:
            walk.ref_cnt -= 1
            if walk.ref_cnt == 0:
                self._num_evictable += walk.num_held
            walk = walk.parent
        self._sync(node)

    def _sync(self, node: TreeNode) -> None:
        """Tell the policy when a node's evictability changed."""
        flag = node.ref_cnt == 0 and not node.children and node is not self.root
        if flag != node.evictable:
            node.evictable = flag
            self.policy.set_evictable(node.id, flag)

    # --- eviction ----------------------------------------------------------------------------
    def evict(self, num_blocks: int, on_evict: EvictCallback | None = None) -> list[int]:
        """Free up to `num_blocks` blocks from unlocked leaves in policy order, trimming the
        last victim's run from its tail if it holds more than needed. Returns the freed ids.

        `on_evict(node, start, block_ids)` runs before blocks [start:] of `node` leave (so a
        write-back tier can read them and call `path_token_ids`); it must neither modify the
        index nor raise (blocks evicted earlier in the call would be lost to the caller).
        """
        freed: list[int] = []
        while len(freed) < num_blocks:
            key = self.policy.victim()
            if key is None:
                break
            node = self._nodes[key]
            if not node.evictable:
                raise IntegrityError(f"policy chose {node!r}, which is not an unlocked leaf")
            start = node.tail_start(num_blocks - len(freed))
            ids = node.held(start)
            if on_evict is not None:
                on_evict(node, start, ids)
            if self.events is not None:
                self.events.emit(removed_event(node, start))
            freed += ids
            if start == 0:
                self._remove_leaf(node)
            else:
                self._trim(node, start)
        return freed

    def _remove_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key(0)]
        del self._nodes[node.id]
        self.policy.remove(node.id, tag=run_tag(node.keys))
        self._num_cached -= node.num_held
        self._num_evictable -= node.num_held
        node.parent = None
        self._sync(parent)

    def _trim(self, node: TreeNode, start: int) -> None:
        tag = run_tag(node.keys[start * HASH_BYTES :])
        dropped = cut_tail(node, start, self._token_bytes)
        self.policy.resize(node.id, node.num_held, tag=tag)
        self._num_cached -= dropped
        self._num_evictable -= dropped

    # --- holes (sliding-window caches) ------------------------------------------------------
    def punch(
        self,
        node: TreeNode,
        lo: int,
        hi: int,
        keep: int,
        align: int = 1,
        owners: list[str] | None = None,
    ) -> list[int]:
        """Drop the K/V of blocks [lo, hi) of `node`'s path, leaving holes (blocks that slid
        out of a running request's sliding window). Keys and tokens stay, so the path still
        matches. The `keep` blocks before each point of the path where prompts branch (a
        node with two or more children) stay, for a prompt that branches there later,
        widened to whole runs of `align` blocks (tier chunks). Returns the freed ids
        (`owners`, if given, gets the owner of each); no event is emitted, since every key
        stays matchable."""
        freed: list[int] = []
        for run, a, b in punch_spans(self._path(node), lo, hi, keep, align):
            ids = punch_run(run, a, b)
            self._recount(run, -len(ids))
            freed += ids
            if owners is not None:
                owners += [run.owner] * len(ids)
        return freed

    def punchable(self, node: TreeNode, lo: int, hi: int, keep: int, align: int = 1) -> list[int]:
        """The held ids `punch` would drop, left in place (a hybrid model's cache lets go of
        their window layers' part only)."""
        return punchable_ids(self._path(node), lo, hi, keep, align)

    # --- paths -------------------------------------------------------------------------------
    def _path(self, node: TreeNode) -> list[TreeNode]:
        return paths.path_to(self.root, node)

    def path_keys(self, node: TreeNode, upto: int | None = None) -> list[bytes]:
        """Block keys from the root through the first `upto` blocks of `node` (default all)."""
        return paths.path_keys(self._path(node), upto)

    def path_token_ids(self, node: TreeNode, upto: int | None = None) -> np.ndarray:
        """Token ids (uint32) from the root through the first `upto` blocks of `node`."""
        return paths.path_token_ids(self._path(node), self._token_bytes, upto)

    def path_block_ids(self, node: TreeNode, upto: int | None = None) -> list[int | None]:
        """Block ids from the root through the first `upto` blocks of `node` (None: a hole)."""
        return paths.path_block_ids(self._path(node), upto)

    def held_by_owner(self) -> Counter[str]:
        """Blocks held per run owner (`TreeNode.owner`)."""
        return paths.held_by_owner(self._nodes.values())

    def all_block_ids(self) -> list[int]:
        """Every block id the index holds."""
        return paths.held_ids(self._nodes.values())

    def snapshot(self) -> list[BlockStored]:
        """Every cached run as a stored event, parents before children (a consumer that
        starts late, or lost events, rebuilds the index's block set from it)."""
        return snapshot_events(self.root, self.block_size)

    # --- integrity ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise IntegrityError unless links, counts, locks and the policy are all consistent."""
        if check_tree(self.root, self._token_bytes) != self._nodes:
            raise IntegrityError("the node table does not match the nodes reachable from the root")
        check_counts(self._nodes, self._num_cached, self._num_evictable, self.policy)
