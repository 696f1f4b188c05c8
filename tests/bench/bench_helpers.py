"""Independent, naive references for the hit-rate replay and the offline bounds, and a
hypothesis strategy of small prefix-chain traces."""

from __future__ import annotations

import itertools

from hypothesis import strategies as st

from bench.hitrate.offline import NEVER
from bench.traces import BlockTrace, from_chains


def chains_from_paths(paths: list[list[int]]) -> list[list[int]]:
    """Prompts as symbol lists -> chains of block ids (one id per distinct prefix)."""
    ids: dict[tuple[int, ...], int] = {}
    return [[ids.setdefault(tuple(p[: k + 1]), len(ids)) for k in range(len(p))] for p in paths]


# prompts over a 3-symbol alphabet share prefixes often, like chat turns and system prompts
paths = st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=7), min_size=1, max_size=14)


@st.composite
def traces(draw: st.DrawFn) -> BlockTrace:
    return from_chains(chains_from_paths(draw(paths)), block_tokens=4)


def requests(trace: BlockTrace) -> list[list[int]]:
    return [trace.request(r).tolist() for r in range(trace.num_requests)]


# --- Belady with bypass: exhaustive search over every demand-paging schedule ---------------
def brute_optimal_hits(trace: BlockTrace, capacity: int) -> int:
    """Max hits over all schedules: on a miss keep the cache, or store the block (evicting any
    one resident block when full). Dynamic programming over resident sets."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for b in trace.blocks.tolist():
        nxt: dict[frozenset[int], int] = {}
        for state, hits in best.items():
            if b in state:
                options = [(state, hits + 1)]
            else:
                options = [(state, hits)]
                if len(state) < capacity:
                    options.append((state | {b}, hits))
                else:
                    options += [((state - {v}) | {b}, hits) for v in state]
            for s, h in options:
                if nxt.get(s, -1) < h:
                    nxt[s] = h
        best = nxt
    return max(best.values())


# --- Belady on leaves: a block-level prefix cache with O(n) scans ---------------------------
def naive_offline_hits(trace: BlockTrace, capacity: int) -> list[int]:
    """Per request hits of the offline reference: evict the unlocked resident leaf block whose
    next use (from the request on) is farthest, larger id first on ties; insert everything."""
    flat, parents, resident, out = trace.blocks.tolist(), trace.parents().tolist(), set(), []
    offsets = trace.offsets.tolist()
    for r, blocks in enumerate(requests(trace)):
        hit = next((j for j, b in enumerate(blocks) if b not in resident), len(blocks))
        locked = set(blocks[:hit])

        def next_use(b: int, start: int = offsets[r]) -> int:
            return next((i for i in range(start, len(flat)) if flat[i] == b), NEVER)

        for _ in range(len(blocks) - hit - (capacity - len(resident))):
            leaves = [
                b for b in resident if b not in locked and b not in {parents[c] for c in resident}
            ]
            if not leaves:
                break
            resident.remove(max(leaves, key=lambda b: (next_use(b), b)))
        resident.update(blocks[hit : hit + min(len(blocks) - hit, capacity - len(resident))])
        out.append(hit)
    return out


# --- block-exact LRU: a block-level prefix cache with O(n) scans ---------------------------
def naive_block_lru_hits(trace: BlockTrace, capacity: int) -> list[int]:
    """Per request hits of block-exact LRU: each block a request hits or inserts is stamped
    with the request; the unlocked resident leaf block with the oldest stamp goes first."""
    parents, stamp, out = trace.parents().tolist(), {}, []
    for r, blocks in enumerate(requests(trace)):
        hit = next((j for j, b in enumerate(blocks) if b not in stamp), len(blocks))
        stamp.update(dict.fromkeys(blocks[:hit], r))
        for _ in range(len(blocks) - hit - (capacity - len(stamp))):
            inner = {parents[c] for c in stamp}
            leaves = [b for b in stamp if b not in inner and b not in blocks[:hit]]
            if not leaves:
                break
            del stamp[min(leaves, key=stamp.__getitem__)]
        stamp.update(
            dict.fromkeys(blocks[hit : hit + min(len(blocks) - hit, capacity - len(stamp))], r)
        )
        out.append(hit)
    return out


# --- LRU over radix runs, as the index kept it before recency was block-exact ----------------
class _Node:
    def __init__(self, node_id: int, parent: _Node | None, blocks: list[int], stamp: int):
        self.id, self.parent, self.blocks, self.stamp = node_id, parent, blocks, stamp
        self.children: list[_Node] = []
        self.locks = 0


class RunLRU:
    """Lists of nodes and linear scans: the least recently used unlocked leaf loses blocks
    from its tail. Recency ticks per run: on every hit (each matched run, the whole run even
    where the hit ends inside it), every run the insert walks through, and every new leaf; a
    split's new head keeps the run's recency and locks. Tests use it to show that a trace
    tells run-level recency from block-exact recency."""

    def __init__(self, capacity: int):
        self.capacity, self.root = capacity, _Node(0, None, [], 0)
        self.ids, self.ticks = itertools.count(1), itertools.count(1)
        self.nodes: list[_Node] = []

    def _child(self, node: _Node, b: int) -> _Node | None:
        return next((c for c in node.children if c.blocks[0] == b), None)

    @staticmethod
    def _common(a: list[int], b: list[int]) -> int:
        return next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )

    def cached(self) -> int:
        return sum(len(n.blocks) for n in self.nodes)

    def serve(self, blocks: list[int]) -> int:
        node, pos = self.root, 0
        while pos < len(blocks) and (child := self._child(node, blocks[pos])) is not None:
            k = self._common(child.blocks, blocks[pos:])
            child.stamp = next(self.ticks)
            node, pos = child, pos + k
            if k < len(child.blocks):
                break
        self._lock(node, 1)
        self._evict(len(blocks) - pos - (self.capacity - self.cached()))
        fit = pos + min(len(blocks) - pos, self.capacity - self.cached())
        if fit > pos:
            self._insert(blocks[:fit])
        self._lock(node, -1)
        return pos

    def _lock(self, node: _Node | None, delta: int) -> None:
        while node is not None:
            node.locks += delta
            node = node.parent

    def _evict(self, need: int) -> None:
        while need > 0:
            leaves = [n for n in self.nodes if not n.children and n.locks == 0]
            if not leaves:
                return
            victim = min(leaves, key=lambda n: (n.stamp, n.id))
            take = min(need, len(victim.blocks))
            del victim.blocks[len(victim.blocks) - take :]
            need -= take
            if not victim.blocks:
                self.nodes.remove(victim)
                victim.parent.children.remove(victim)

    def _insert(self, blocks: list[int]) -> None:
        node, pos = self.root, 0
        while pos < len(blocks):
            child = self._child(node, blocks[pos])
            if child is None:
                self._add(node, blocks[pos:])
                return
            k = self._common(child.blocks, blocks[pos:])
            child.stamp = next(self.ticks)
            if k == len(child.blocks):
                node, pos = child, pos + k
                continue
            if pos + k < len(blocks):
                head = self._split(child, k)
                self._add(head, blocks[pos + k :])
            return

    def _split(self, child: _Node, k: int) -> _Node:
        parent = child.parent
        head = _Node(next(self.ids), parent, child.blocks[:k], child.stamp)
        head.locks, child.blocks = child.locks, child.blocks[k:]
        parent.children[parent.children.index(child)] = head
        head.children, child.parent = [child], head
        self.nodes.append(head)
        return head

    def _add(self, parent: _Node, blocks: list[int]) -> None:
        leaf = _Node(next(self.ids), parent, list(blocks), next(self.ticks))
        parent.children.append(leaf)
        self.nodes.append(leaf)


def run_lru_hits(trace: BlockTrace, capacity: int) -> list[int]:
    cache = RunLRU(capacity)
    return [cache.serve(blocks) for blocks in requests(trace)]
