"""`python -m bench faults --soak SECONDS`: a bounded soak of a live `kvstore serve`.

16 streaming clients (LMDB and the private Redis) for SECONDS, with faults picked at random
every 5 to 15 s: Redis SIGKILLed and restarted, Redis SIGSTOPped for 1 s, a burst of clients
leaving mid-stream, a burst of bad requests. A warm-up (a fifth of the time, at least 30 s
and at most 120 s) runs first; the server's RSS, open file descriptors and threads are read
from /proc at idle after it and again at idle after the soak. Every answer is checked
against the no-cache reference; blocks held after the clients stop and the integrity check
at close are reported.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.faults.common import Context
from bench.faults.concurrent import BAD_BODIES, prompts
from bench.faults.live import Answer, LiveServer, stream
from bench.faults.load_report import MAX_TOKENS, answer_is_right, refusal

# A pool that fills during the warm-up, so eviction runs all along; the default (1 GiB, of
# which a block of the micro model is 2 KiB) would still be touching new pages at the end.
SOAK_BLOCKS = 512
IDLE_S = 11.0  # wait before an idle reading: longer than anyio keeps an idle worker thread
# The warm-up's bounds. Under load the server starts threads it then keeps for good: after a
# 4 s warm-up (a 20 s soak's fifth) it had 8, after 12 s the 10 it keeps (as after 120 s),
# so a shorter warm-up reads the growth of a steady state as a leak.
WARM_S = (30.0, 120.0)


@dataclass
class Sample:
    rss_mib: float  # anonymous memory: the heap; file-backed pages (LMDB's map) are apart
    rss_file_mib: float
    fds: int
    threads: int


@dataclass
class SoakReport:
    seconds: float
    clients: int
    answers: int
    succeeded: int
    refused: int  # documented 4xx/5xx with a reason, bad requests included
    left: int  # clients that left on purpose
    failed: int
    wrong_outputs: int
    faults: dict[str, int]
    warm: Sample
    end: Sample
    leaked_blocks: int
    integrity_ok: bool

    @property
    def rss_growth(self) -> float:
        return self.end.rss_mib / self.warm.rss_mib - 1.0


def read_proc(pid: int) -> Sample:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    anon, file = (int(fields[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile"))
    return Sample(
        rss_mib=anon,
        rss_file_mib=file,
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        threads=int(fields["Threads"]),
    )


def idle_reading(server: LiveServer) -> Sample:
    """Read the server at idle, once the request threads it grew have expired (anyio keeps
    an idle worker 10 s, and retires expired ones on its next call: a /health read)."""
    time.sleep(IDLE_S)
    server.health()
    time.sleep(0.5)
    return read_proc(server.proc.pid)


class Clients:
    """`n` threads sending requests until stopped; a few leave early or send bad bodies."""

    def __init__(self, url: str, n: int, seed: int = 0):
        self.url, self.pool = url, prompts(64, seed=seed + 40)
        self.answers: list[Answer] = []
        self.leave_share = self.bad_share = 0.02
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(seed + i,), daemon=True) for i in range(n)
        ]

    def start(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            roll = rng.random()
            if roll < self.bad_share:
                answer = stream(self.url, [], 0, payload=rng.choice(BAD_BODIES))
            else:
                leave = rng.randint(1, 8) if roll < self.bad_share + self.leave_share else None
                answer = stream(self.url, rng.choice(self.pool), MAX_TOKENS, leave_after=leave)
            self.answers.append(answer)


def faults(ctx: Context, clients: Clients) -> dict[str, Callable[[], None]]:
    def redis_kill() -> None:
        ctx.redis.kill()
        time.sleep(1.0)
        ctx.redis.restart()

    def redis_stop() -> None:
        ctx.redis.pause()
        time.sleep(1.0)
        ctx.redis.resume()

    def burst(attr: str) -> Callable[[], None]:
        def run() -> None:
            setattr(clients, attr, 0.3)
            time.sleep(3.0)
            setattr(clients, attr, 0.02)

        return run

    return {
        "redis-kill": redis_kill,
        "redis-stop": redis_stop,
        "disconnect-burst": burst("leave_share"),
        "bad-input-burst": burst("bad_share"),
    }


def soak(ctx: Context, seconds: float, n_clients: int = 16, seed: int = 0) -> SoakReport:
    server = LiveServer(ctx, "soak", "--device-blocks", str(SOAK_BLOCKS)).start().wait_ready()
    rng, counts = random.Random(seed), {}
    warm_s = min(WARM_S[1], max(WARM_S[0], seconds / 5))
    try:
        warm_clients = Clients(server.url, n_clients, seed).start()
        time.sleep(warm_s)
        warm_clients.stop()
        warm = idle_reading(server)
        clients = Clients(server.url, n_clients, seed + 100).start()
        table, end_at = faults(ctx, clients), time.monotonic() + seconds
        while time.monotonic() < end_at:
            time.sleep(min(rng.uniform(5, 15), max(0.0, end_at - time.monotonic())))
            if time.monotonic() < end_at - 5:
                name = rng.choice(sorted(table))
                table[name]()
                counts[name] = counts.get(name, 0) + 1
        clients.stop()
        end = idle_reading(server)
        leaked = server.held_blocks()
    finally:
        integrity_ok, held, _ = server.shut_down()
    return report(
        ctx,
        clients.answers,
        seconds=seconds,
        clients=n_clients,
        faults=counts,
        warm=warm,
        end=end,
        leaked_blocks=leaked,
        integrity_ok=integrity_ok and held == 0,
    )


def report(
    ctx: Context,
    answers: list[Answer],
    *,
    seconds: float,
    clients: int,
    faults: dict[str, int],
    warm: Sample,
    end: Sample,
    leaked_blocks: int,
    integrity_ok: bool,
) -> SoakReport:
    """The soak's report: `answers` tallied, beside what the run found."""
    ok = [a for a in answers if a.ok]
    refused = sum(refusal(a) is not None for a in answers if not a.ok)
    left = sum(a.cancelled for a in answers)
    return SoakReport(
        answers=len(answers),
        succeeded=len(ok),
        refused=refused,
        left=left,
        failed=len(answers) - len(ok) - refused - left,
        wrong_outputs=sum(not answer_is_right(ctx.model, a) for a in ok),
        seconds=seconds,
        clients=clients,
        faults=faults,
        warm=warm,
        end=end,
        leaked_blocks=leaked_blocks,
        integrity_ok=integrity_ok,
    )


def markdown(r: SoakReport, command: str) -> str:
    faults_run = ", ".join(f"{n}x {k}" for k, n in sorted(r.faults.items())) or "none"
    return "\n".join(
        [
            "## Soak",
            "",
            f"`{command}`: {r.clients} streaming clients for {r.seconds:.0f} s after a warm-up, "
            f"device pool {SOAK_BLOCKS} blocks (it fills, so eviction runs throughout); "
            f"faults at random every 5 to 15 s ({faults_run}). Readings at idle, after the "
            "warm-up and after the soak.",
            "",
            "| Answers | Succeeded | Refused (documented) | Left by client | Failed "
            "| Wrong outputs | Leaked blocks | Integrity at close | RSS anon MiB (growth) "
            "| RSS file MiB | File descriptors | Threads |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            f"| {r.answers} | {r.succeeded} | {r.refused} | {r.left} | {r.failed} | "
            f"{r.wrong_outputs} | {r.leaked_blocks} | {'ok' if r.integrity_ok else 'FAILED'} | "
            f"{r.warm.rss_mib:.0f} -> {r.end.rss_mib:.0f} ({r.rss_growth:+.1%}) | "
            f"{r.warm.rss_file_mib:.0f} -> {r.end.rss_file_mib:.0f} | "
            f"{r.warm.fds} -> {r.end.fds} | {r.warm.threads} -> {r.end.threads} |",
            "",
            "RSS anon is the process's own memory (the growth that would be a leak); RSS file is "
            "file-backed pages, mostly LMDB's map, which grows with the entries written and is "
            "the kernel's to drop. The server trims glibc's heap once it has had no request in "
            "flight for 2 s (engine/server/heap.py), so an idle reading is the memory in use, "
            "not the free memory glibc kept inside its arenas.",
            "",
            verdict(r),
            "",
        ]
    )


def verdict(r: SoakReport) -> str:
    """The must-haves, and which of them a run missed."""
    missed = [
        text
        for ok, text in (
            (r.rss_growth < 0.05, f"RSS anon grew {r.rss_growth:+.1%}"),
            (r.end.fds <= r.warm.fds, "file descriptors grew"),
            (r.end.threads <= r.warm.threads, "threads grew"),
            (r.wrong_outputs == r.failed == r.leaked_blocks == 0, "wrong, failed or leaked"),
            (r.integrity_ok, "integrity failed"),
        )
        if not ok
    ]
    head = (
        "Must-haves: RSS anon growth under 5%, no growth in file descriptors or threads, "
        "0 failed, 0 wrong, 0 leaked blocks, integrity ok: "
    )
    return head + ("held." if not missed else "**missed**: " + "; ".join(missed) + ".")


def holds(r: SoakReport) -> bool:
    """The soak's must-haves: RSS growth under 5%, no fd or thread growth, nothing wrong,
    failed or leaked."""
    return (
        r.rss_growth < 0.05
        and r.end.fds <= r.warm.fds
        and r.end.threads <= r.warm.threads
        and r.wrong_outputs == 0
        and r.failed == 0
        and r.leaked_blocks == 0
        and r.integrity_ok
    )
