"""The eviction-policy interface: the `Policy` ABC every policy implements, and the error its
integrity checks raise. The policies live beside it (`heap`, `fifo`, `lhd`); the package
registers them by name."""

from __future__ import annotations

from abc import ABC, abstractmethod


class IntegrityError(AssertionError):
    """An internal invariant of the index or of its policy does not hold."""


class Policy(ABC):
    """Orders evictable entries (opaque int keys, each with a size in blocks).

    Protocol: `insert` a new entry (not evictable until `set_evictable(key, True)`), report
    hits with `access` and later uses by the same request with `touch`, keep sizes current
    with `resize`, and `remove` an entry when its blocks are gone. `victim` never removes
    anything: the caller evicts the named entry (`remove`) or part of it (`resize`).

    `tag` is a content fingerprint of a run of blocks (e.g. its first block hash as an int);
    policies that remember evicted content (S3-FIFO's ghost queue) use it, others ignore it.
    """

    @abstractmethod
    def insert(self, key: int, size: int, tag: int | None = None, like: int | None = None) -> None:
        """Add an entry. `like` names an entry whose history the new one inherits (a split)."""

    @abstractmethod
    def remove(self, key: int, tag: int | None = None) -> None:
        """Drop an entry whose blocks were evicted; `tag` fingerprints the evicted run."""

    @abstractmethod
    def resize(self, key: int, size: int, tag: int | None = None) -> None:
        """Change an entry's size; `tag` (set when blocks were evicted) fingerprints them."""

    @abstractmethod
    def access(self, key: int) -> None:
        """A hit: a request reused the entry."""

    @abstractmethod
    def touch(self, key: int) -> None:
        """The request that holds the entry used it again (refreshes recency, not frequency)."""

    @abstractmethod
    def set_evictable(self, key: int, flag: bool) -> None:
        """Mark whether the entry may be chosen by `victim`."""

    @abstractmethod
    def victim(self) -> int | None:
        """Key of the evictable entry to evict next, or None when nothing is evictable."""

    @abstractmethod
    def entries(self) -> dict[int, tuple[int, bool]]:
        """Every tracked entry as key -> (size, evictable), for integrity checks."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise IntegrityError if the policy's internal state is inconsistent."""
