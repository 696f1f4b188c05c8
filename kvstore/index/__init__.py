"""The radix index: longest-prefix match over chained block hashes (`RadixIndex` in
radix.py), over path-compressed runs of blocks (`TreeNode` in tree.py)."""

from kvstore.index.policies import IntegrityError
from kvstore.index.radix import RadixIndex
from kvstore.index.tree import MatchResult, TreeNode

__all__ = ["IntegrityError", "MatchResult", "RadixIndex", "TreeNode"]
