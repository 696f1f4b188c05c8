"""The wait queue: per-tenant FIFO queues served round-robin, bounded, where a tenant
flooding a full queue gives way to a quieter one (engine/loop/scheduler.py takes from it)."""

from __future__ import annotations

import threading
from collections import deque

from engine.loop.request import QueueFullError, Request


class WaitQueue:
    """Per-tenant FIFO deques served round-robin; thread-safe."""

    def __init__(self) -> None:
        self._queues: dict[str | None, deque[Request]] = {}
        self._turns: deque[str | None] = deque()  # tenants with waiting requests, next first
        self._lock = threading.Lock()
        self.size = 0

    def push(
        self, request: Request, bound: int | None = None, front: bool = False
    ) -> Request | None:
        """Queue `request`. At the bound, a tenant holding at least two more waiting requests
        than this one's tenant gives up its newest never-started one, which is returned (the
        caller refuses it); otherwise QueueFullError. A flood thus fills its own share, and
        a quiet tenant still gets in."""
        with self._lock:
            displaced = None
            if bound is not None and self.size >= bound:
                displaced = self._displace(request.tenant)
                if displaced is None:
                    raise QueueFullError(f"{self.size} requests are waiting (the bound)")
            queue = self._queues.setdefault(request.tenant, deque())
            if not queue:
                (self._turns.appendleft if front else self._turns.append)(request.tenant)
            (queue.appendleft if front else queue.append)(request)
            self.size += 1
            return displaced

    def _displace(self, tenant: str | None) -> Request | None:
        """Take the newest never-started request of the tenant with the most waiting, if it
        holds at least 2 more than `tenant` (under the lock)."""
        mine = len(self._queues.get(tenant, ()))
        other = max(self._turns, key=lambda t: len(self._queues[t]), default=None)
        queue = self._queues.get(other)
        if other == tenant or queue is None or len(queue) < mine + 2:
            return None
        victim = next((r for r in reversed(queue) if r.scheduled is None), None)
        if victim is not None:
            queue.remove(victim)
            self.size -= 1
        return victim

    def candidates(self) -> list[Request]:
        """Every waiting request in the order they would be popped (round-robin)."""
        with self._lock:
            queues = [list(self._queues[tenant]) for tenant in self._turns]
        depth = max((len(q) for q in queues), default=0)
        return [q[i] for i in range(depth) for q in queues if i < len(q)]

    def take(self, request: Request) -> bool:
        """Pop `request` (a candidate): its tenant's turn goes to the back, as with `pop`.
        False if it left the queue meanwhile (cancelled, or displaced by `push`)."""
        with self._lock:
            queue = self._queues.get(request.tenant)
            if queue is None or request not in queue:
                return False
            queue.remove(request)
            self._turns.remove(request.tenant)
            if queue:
                self._turns.append(request.tenant)
            self.size -= 1
            return True

    def pop(self) -> Request:
        """The head of the tenant whose turn it is; that tenant goes to the back."""
        with self._lock:
            tenant = self._turns.popleft()
            queue = self._queues[tenant]
            request = queue.popleft()
            if queue:
                self._turns.append(tenant)
            self.size -= 1
            return request

    def remove(self, request: Request) -> bool:
        """Take a waiting request out of the queue; False if it is not waiting."""
        with self._lock:
            queue = self._queues.get(request.tenant)
            if queue is None or request not in queue:
                return False
            queue.remove(request)
            if not queue:
                self._turns.remove(request.tenant)
            self.size -= 1
            return True

    def drain(self) -> list[Request]:
        with self._lock:
            out = [r for tenant in self._turns for r in self._queues[tenant]]
            self._queues.clear()
            self._turns.clear()
            self.size = 0
            return out

    def by_tenant(self) -> dict[str | None, int]:
        with self._lock:
            return {t: len(q) for t, q in self._queues.items() if q}
