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

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


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
