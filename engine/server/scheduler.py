"""Fair admission in front of the engine: FIFO within a tenant, round-robin across tenants.

The engine has one worker, so the dispatcher thread hands it one request at a time and waits
for it to finish; everything else waits here, where the order is fair and the bound is
enforced. A full queue refuses at once (`QueueFullError`, answered with 429).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.engine import Engine, GenerateResult, SamplingParams, TokenCallback


class QueueFullError(Exception):
    """The wait queue is at its bound; retry later."""


class SchedulerClosedError(RuntimeError):
    """The server is shutting down; no request is accepted or will run."""


class RequestCancelled(Exception):
    """Raised from the token callback of a cancelled running request: the engine stops it."""


@dataclass(eq=False)
class Job:
    """One request on its way through the scheduler; `future` resolves to a GenerateResult."""

    tenant: str | None
    token_ids: list[int]
    params: SamplingParams
    salt: str
    on_token: TokenCallback | None = None
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)
    dispatched: float | None = None
    first_token: float | None = None
    cancelled: bool = False

    def emit(self, token_id: int) -> None:
        """The engine's token callback (worker thread)."""
        if self.cancelled:
            raise RequestCancelled("the client went away")
        if self.first_token is None:
            self.first_token = time.perf_counter()
        if self.on_token is not None:
            self.on_token(token_id)

    @property
    def queue_wait_s(self) -> float | None:
        return None if self.dispatched is None else self.dispatched - self.enqueued

    @property
    def ttft_s(self) -> float | None:
        """From arrival to the first generated token, queueing included."""
        return None if self.first_token is None else self.first_token - self.enqueued


class QueueStats(NamedTuple):
    waiting: int
    running: int
    waiting_by_tenant: dict[str | None, int]


DoneCallback = Callable[[Job, GenerateResult | None], None]


class Scheduler:
    """Per-tenant FIFO deques served round-robin by one dispatcher thread."""

    def __init__(self, engine: Engine, max_queue: int, on_done: DoneCallback | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self._on_done = on_done
        self._queues: dict[str | None, deque[Job]] = {}
        self._turns: deque[str | None] = deque()  # tenants with waiting jobs, next first
        self._waiting = 0
        self._running: Job | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._dispatch_loop, name="kvstore-dispatch")
        self._thread.daemon = True
        self._thread.start()

    def submit(self, job: Job) -> Job:
        """Queue `job`; raises QueueFullError when `max_queue` requests already wait."""
        with self._cond:
            if self._closed:
                raise SchedulerClosedError("the server is shutting down")
            if self._waiting >= self.max_queue:
                raise QueueFullError(f"{self._waiting} requests are waiting (the bound)")
            queue = self._queues.setdefault(job.tenant, deque())
            if not queue:
                self._turns.append(job.tenant)
            queue.append(job)
            self._waiting += 1
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Drop a waiting job, or make a running one stop at its next token."""
        with self._cond:
            job.cancelled = True
            queue = self._queues.get(job.tenant)
            dropped = queue is not None and job in queue
            if dropped:
                queue.remove(job)
                self._waiting -= 1
                if not queue:
                    self._turns.remove(job.tenant)
        if dropped and job.future.cancel() and self._on_done is not None:
            self._on_done(job, None)

    def stats(self) -> QueueStats:
        with self._cond:
            by_tenant = {t: len(q) for t, q in self._queues.items() if q}
            return QueueStats(self._waiting, int(self._running is not None), by_tenant)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _pop(self) -> Job:
        """The next job: the head of the tenant whose turn it is (caller holds the lock)."""
        tenant = self._turns.popleft()
        queue = self._queues[tenant]
        job = queue.popleft()
        if queue:
            self._turns.append(tenant)
        self._waiting -= 1
        return job

    def _dispatch_loop(self) -> None:
        while True:
            with self._cond:
                while not self._turns and not self._closed:
                    self._cond.wait()
                if not self._turns:
                    return
                job = self._running = self._pop()
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: Job) -> None:
        job.dispatched = time.perf_counter()
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            engine_future = self.engine.submit(
                job.token_ids,
                job.params,
                cache_salt=job.salt,
                on_token=job.emit,
                tenant=job.tenant or "",
            )
            result = engine_future.result()
        except BaseException as e:  # handed to the request's handler
            job.future.set_exception(e)
            result = None
        else:
            job.future.set_result(result)
        if self._on_done is not None:
            self._on_done(job, result)

    def close(self) -> None:
        """Refuse new jobs, fail the waiting ones, let the running one finish. Idempotent."""
        with self._cond:
            self._closed = True
            waiting = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            self._turns.clear()
            self._waiting = 0
            self._cond.notify_all()
        for job in waiting:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(SchedulerClosedError("the server is shutting down"))
        self._thread.join()
