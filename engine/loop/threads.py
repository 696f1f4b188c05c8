"""Which thread does a CPU model's work, and why it matters.

On a CPU, torch runs parallel regions through libgomp, which keeps a team of worker threads
for every thread that ever started one. While more such threads are alive than the machine
has cores, libgomp's workers stop spinning between regions (its "throttled" spin count) and
each region pays for waking them: a decode step of SmolLM2 on 2 cores went from 37 to
52-66 ms once a second thread had run one parallel op (docs/ARCHITECTURE.md, "Threads").
So the engine does its model work on its own loop thread, and `load_model` loads on a thread
that ends with the loading, leaving no team behind.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")
log = logging.getLogger("kvstore.engine")


def on_own_thread(function: Callable[..., T], *args: object) -> T:
    """`function(*args)` on a new thread, joined; its exception is raised here."""
    done: Future = Future()
    thread = threading.Thread(
        target=settle, args=(lambda: function(*args), done), name="kvstore-load", daemon=True
    )
    thread.start()
    thread.join()
    return done.result()


def settle(function: Callable[[], object], done: Future) -> None:
    """`done` gets what `function()` returns, or what it raises."""
    try:
        done.set_result(function())
    except BaseException as e:  # the waiting thread's to handle
        done.set_exception(e)


class LoopCalls:
    """Functions other threads hand to an engine's loop thread, which runs them between its
    steps (`take` under the loop's condition, then `run`)."""

    def __init__(self, cond: threading.Condition) -> None:
        self.cond = cond
        self.pending: list[tuple[Callable[[], object], Future]] = []
        self.thread: threading.Thread | None = None  # the loop thread

    def call(self, function: Callable[[], T], refuse: Callable[[], BaseException | None]) -> T:
        """`function()` on the loop thread, waited for; `refuse()` (checked under the
        condition) is raised instead when it says the loop takes no more calls."""
        if threading.current_thread() is self.thread:
            return function()
        done: Future = Future()
        with self.cond:
            error = refuse()
            if error is not None:
                raise error
            self.pending.append((function, done))
            self.cond.notify_all()
        return done.result()

    def take(self) -> list[tuple[Callable[[], object], Future]]:
        """The pending calls, handed over (the caller holds the condition)."""
        calls, self.pending = self.pending, []
        return calls

    @staticmethod
    def run(calls: list[tuple[Callable[[], object], Future]]) -> None:
        for function, done in calls:
            settle(function, done)

    def close(self, error: BaseException) -> None:
        """The loop is gone: every call still pending fails with `error` (the caller holds
        the condition, and has made `refuse` refuse new ones)."""
        for _, done in self.take():
            done.set_exception(error)


@dataclass(frozen=True)
class ThreadConfig:
    """How many threads the loop thread's torch team runs.

    threads: the most it runs (None: torch's count where the engine was made, which
        OMP_NUM_THREADS sets). adapt: on a CPU, every `interval_s` the team is sized to the
        cores other processes leave free (at least one). A team wider than the free cores
        makes each parallel region wait for a descheduled worker: beside two busy processes
        on 2 cores, a 2-thread decode step took 60.8 ms against a 1-thread one's 30.5
        (docs/BENCHMARKS.md, "Contention")."""

    threads: int | None = None
    adapt: bool = True
    interval_s: float = 0.25

    def __post_init__(self) -> None:
        if self.threads is not None and (isinstance(self.threads, bool) or self.threads < 1):
            raise ValueError(f"threads must be an int >= 1 or None, got {self.threads!r}")
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s!r}")


def busy_cpu_s() -> float | None:
    """CPU seconds every process has run since boot (/proc/stat), or None off Linux."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """Sizes the calling thread's torch team to the cores others leave free (`tick` between
    steps); `threads` is the team now. Others' load is the machine's busy CPU time less this
    process's, over the last interval."""

    def __init__(self, config: ThreadConfig, max_threads: int, num_cpus: int | None = None):
        self.config, self.max_threads = config, max_threads
        self.num_cpus = num_cpus or os.cpu_count() or 1
        self.threads = max_threads
        self.changes = 0  # how often the team was resized (metrics, tests)
        self.on = config.adapt and max_threads > 1 and busy_cpu_s() is not None
        self._mark = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        return time.monotonic(), busy_cpu_s() or 0.0, time.process_time()

    def start(self, window_s: float = 0.1) -> None:
        """Size the team before the first step: by the load over at least `window_s` since
        this governor was made (the engine's start-up, then a wait for the rest)."""
        if self.on:
            time.sleep(max(0.0, window_s - (time.monotonic() - self._mark[0])))
            self.tick(min_window_s=window_s)

    def tick(self, min_window_s: float | None = None) -> None:
        """Resize the team if the last `interval_s` (or `min_window_s`, at start) is over."""
        least = self.config.interval_s if min_window_s is None else min_window_s
        if not self.on or time.monotonic() - self._mark[0] < least:
            return
        now = self._sample()
        wall, busy, own = (b - a for a, b in zip(self._mark, now, strict=True))
        self._mark = now
        others = max(0.0, busy - own) / wall
        if (threads := self.fit(others)) != self.threads:
            log.debug(
                "torch threads %d -> %d: %.1f cores busy elsewhere", self.threads, threads, others
            )
            self.resize(threads)

    def fit(self, others: float) -> int:
        """The team for `others` cores busy elsewhere: the free cores, rounded, 1 at least."""
        return max(1, min(self.max_threads, int(self.num_cpus - others + 0.5)))

    def resize(self, threads: int) -> None:
        torch.set_num_threads(threads)
        self.threads, self.changes = threads, self.changes + 1
