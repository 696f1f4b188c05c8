"""Closed-loop chat sessions against one server: `concurrency` workers, each taking a whole
session and sending its turns one after another (turn k+1 carries the answer to turn k)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from bench.load.client import ChatOutcome, send_chat
from bench.load.workload import ChatSession

REPLACEMENT = "\ufffd"  # what an undecodable byte renders as


@dataclass(frozen=True)
class Request:
    """What every request of a run shares: where it goes and how it generates."""

    url: str
    extra: dict  # the server's own body fields (model, ignore_eos, ...)
    max_tokens: int
    timeout_s: float
    api_key: str | None = None

    def body(self, messages: list[dict]) -> dict:
        return {"messages": messages, "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True, **self.extra}  # fmt: skip


Think = Callable[[ChatSession, int], None]  # runs before each turn but the first


def run_session(
    client: httpx.Client,
    request: Request,
    session: ChatSession,
    done: Callable[[ChatOutcome], None],
    think: Think | None = None,
) -> None:
    """The session's turns in order; a failed turn ends the session (no answer to go on).
    Each answer goes back as the assistant's message without a trailing U+FFFD: an incomplete
    UTF-8 tail that kvstore renders as U+FFFD and `transformers serve` drops, so both servers
    get the same history when they generated the same tokens."""
    answers: list[str] = []
    for turn in range(len(session.questions)):
        if turn and think is not None:
            think(session, turn)
        body = request.body(session.messages(answers))
        out = send_chat(client, request.url, body, request.api_key)
        out.session, out.turn = session.index, turn
        done(out)
        if not out.ok:
            return
        answers.append(out.text.rstrip(REPLACEMENT))


def run_level(
    request: Request,
    sessions: list[ChatSession],
    concurrency: int,
    bar=None,
    think: Think | None = None,
) -> tuple[list[ChatOutcome], float]:
    """Every session through `concurrency` closed-loop workers: (outcomes, wall seconds);
    `think(session, turn)` (a user's pause) runs before each turn but the first."""
    work: queue.Queue[ChatSession] = queue.Queue()
    for session in sessions:
        work.put(session)
    outcomes: list[ChatOutcome] = []
    lock = threading.Lock()

    def done(out: ChatOutcome) -> None:
        with lock:
            outcomes.append(out)
        if bar is not None:
            bar.update(1)

    def worker() -> None:
        with httpx.Client(timeout=request.timeout_s) as client:
            while True:
                try:
                    session = work.get_nowait()
                except queue.Empty:
                    return
                run_session(client, request, session, done, think)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes, time.perf_counter() - start


def warm_up(request: Request, session: ChatSession) -> ChatOutcome:
    """One request, not measured; RuntimeError if it fails (the server cannot serve)."""
    with httpx.Client(timeout=request.timeout_s) as client:
        out = send_chat(client, request.url, request.body(session.messages([])), request.api_key)
    if not out.ok:
        raise RuntimeError(f"warm-up request failed (HTTP {out.status}): {out.error}")
    return out
