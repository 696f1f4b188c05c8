"""Holes: blocks of a run whose K/V the index dropped while their keys and tokens stay, so
paths through them still match (a sliding-window cache's blocks that slid out of a running
request's window, see `RadixIndex.punch`).

These functions change or read block ids only; the index does the bookkeeping (counts,
policy sizes) for the blocks they fill or free.
"""

from __future__ import annotations

from array import array

from kvstore.index.tree import HOLE, TreeNode
from kvstore.units import cdiv

__all__ = ["fill_holes", "minus", "punch_run", "punch_spans", "punchable_ids", "widen"]


def fill_holes(node: TreeNode, ids: list[int | None]) -> tuple[list[int], list[int]]:
    """(unkept, filled) for the caller's ids[i] at `node`'s matched block i: a hole takes the
    caller's block (filled, the node keeps it); the caller's other ids are unkept."""
    held = node.block_ids
    unkept, filled = [], []
    for i, b in enumerate(ids):
        if b is None or held[i] == b:
            continue
        if held[i] == HOLE:
            held[i] = b
            filled.append(b)
        else:
            unkept.append(b)
    return unkept, filled


def punch_spans(
    path: list[TreeNode], lo: int, hi: int, keep: int, align: int
) -> list[tuple[TreeNode, int, int]]:
    """(run, first, end) within each run of `path` (root excluded, root side first): blocks
    [lo, hi) of the path less the `keep` blocks before each branch point (a run with two or
    more children), widened to whole runs of `align` blocks."""
    kept = [widen(r.start + r.num_blocks, keep, align) for r in path if len(r.children) > 1]
    spans = []
    for run in path:
        a, b = max(lo, run.start), min(hi, run.start + run.num_blocks)
        spans += [(run, x - run.start, y - run.start) for x, y in minus(a, b, kept)]
    return spans


def punch_run(node: TreeNode, a: int, b: int) -> list[int]:
    """Make blocks [a, b) of `node`'s run holes; returns the ids they held."""
    ids = node.held(a, b)
    if ids:
        node.block_ids[a:b] = array("q", [HOLE]) * (b - a)
    return ids


def widen(end: int, keep: int, align: int) -> tuple[int, int]:
    """Blocks [end - keep, end), widened to multiples of `align`."""
    return (end - keep) // align * align, cdiv(end, align) * align


def minus(a: int, b: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[a, b) less every range, as sorted disjoint ranges."""
    parts = [(a, b)] if a < b else []
    for lo, hi in ranges:
        parts = [p for x, y in parts for p in ((x, min(y, lo)), (max(x, hi), y)) if p[0] < p[1]]
    return parts


def punchable_ids(path: list[TreeNode], lo: int, hi: int, keep: int, align: int = 1) -> list[int]:
    """The held ids a punch of blocks [lo, hi) of `path` would drop (`punch_spans`)."""
    return [i for run, a, b in punch_spans(path, lo, hi, keep, align) for i in run.held(a, b)]
