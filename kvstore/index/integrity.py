"""The radix index's consistency checks (`RadixIndex.check_integrity`): links, per-node
shape, lock counts, evictable flags, block counts and the policy's view, each raising
IntegrityError on the first inconsistency found."""

from __future__ import annotations

from hashing import HASH_BYTES
from kvstore.index.policies import IntegrityError, Policy
from kvstore.index.tree import TreeNode, count_held

__all__ = ["check_counts", "check_tree"]


def check_tree(root: TreeNode, token_bytes: int) -> dict[int, TreeNode]:
    """Check every node reachable from `root` and its links; returns them by id (root
    excluded). `token_bytes` is the bytes of one block's token ids."""
    seen: dict[int, TreeNode] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        check_node(node, node is root, token_bytes)
        for first_key, child in node.children.items():
            if child.parent is not node or child.key(0) != first_key:
                raise IntegrityError(f"{child!r} is linked under a wrong parent or key")
            if child.id in seen:
                raise IntegrityError(f"{child!r} is reachable twice")
            seen[child.id] = child
            stack.append(child)
    return seen


def check_node(node: TreeNode, is_root: bool, token_bytes: int) -> None:
    m = node.num_blocks
    if not is_root:
        parent = node.parent
        assert parent is not None
        if m < 1 or node.start != parent.start + parent.num_blocks:
            raise IntegrityError(f"{node!r} is empty or its start is wrong")
    if node.num_held != count_held(node.block_ids):
        raise IntegrityError(f"{node!r} num_held is {node.num_held}, it holds otherwise")
    if len(node.keys) != m * HASH_BYTES or len(node.tokens) != m * token_bytes:
        raise IntegrityError(f"{node!r} keys/tokens do not cover its {m} blocks")
    children_refs = sum(c.ref_cnt for c in node.children.values())
    if node.ref_cnt < children_refs or node.ref_cnt < 0:
        raise IntegrityError(f"{node!r} ref_cnt < its children's sum {children_refs}")
    flag = node.ref_cnt == 0 and not node.children and not is_root
    if node.evictable != flag:
        raise IntegrityError(f"{node!r} evictable flag is {node.evictable}, should be {flag}")


def check_counts(
    nodes: dict[int, TreeNode], num_cached: int, num_evictable: int, policy: Policy
) -> None:
    """The index's running counts and its policy's entries agree with `nodes` (root excluded)."""
    ids = [i for node in nodes.values() for i in node.held()]
    if len(ids) != num_cached:
        raise IntegrityError(f"num_cached_blocks {num_cached} != {len(ids)} held")
    if len(set(ids)) != len(ids):
        raise IntegrityError("a block id is held twice")
    evictable = sum(n.num_held for n in nodes.values() if n.ref_cnt == 0)
    if evictable != num_evictable:
        raise IntegrityError(f"num_evictable_blocks {num_evictable} != {evictable}")
    expected = {n.id: (n.num_held, n.evictable) for n in nodes.values()}
    if policy.entries() != expected:
        raise IntegrityError("policy entries (sizes / evictable flags) out of sync with nodes")
    policy.check_integrity()
