"""The concurrent fault family: faults under many streaming clients on a live `kvstore serve`
(the batched engine) with LMDB and the private Redis.

Each scenario runs its workload twice on one server: a baseline half without the fault (its
TTFTs are the baseline), then the whole workload with the fault. After it:
- every completed answer is checked against the micro model's own no-cache forward;
- the device blocks held by requests must be back to 0 once the clients are done (leaks);
- SIGTERM: the server drains, closes and checks index and pool (`check_integrity`), and logs
  how many blocks were still held;
- a fresh server on the same LMDB re-sends every answered prompt: each must hit in full
  (lost entries), unless LMDB itself evicted or dropped entries, which it counts.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from bench.faults.common import BS, Context
from bench.faults.live import Answer, LiveServer, Streaming, run_clients, stream, wait_until
from bench.faults.load_report import MAX_TOKENS, Checks, LoadOutcome, percentile_ms, tally
from bench.faults.storage import small_tmpfs

PREFIXES, PREFIX_BLOCKS, OWN_BLOCKS = 4, 6, 4  # prompts share one of 4 six-block prefixes


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    heads = [rng.integers(0, 256, PREFIX_BLOCKS * BS).tolist() for _ in range(PREFIXES)]
    return [
        heads[i % PREFIXES] + rng.integers(0, 256, OWN_BLOCKS * BS + 1).tolist() for i in range(n)
    ]


class Run:
    """One scenario's server, workload and tallies."""

    def __init__(
        self,
        ctx: Context,
        tag: str,
        *server_args: str,
        redis: bool = True,
        may_evict: bool = False,
    ) -> None:
        """`may_evict`: the fault makes LMDB evict or drop entries (they explain misses)."""
        self.ctx, self.tag, self.may_evict = ctx, tag, may_evict
        self.clients = ctx.scale.load_clients
        self.streaming = Streaming()  # this run's streams, as its clients see them
        self.server = LiveServer(ctx, tag, *server_args, redis=redis).start().wait_ready()
        self.base = run_clients(self.jobs(prompts(self.clients, seed=1)), self.clients)

    def jobs(self, batch: list[list[int]], **kw: object) -> list[Callable[[], Answer]]:
        url = self.server.url
        return [  # type: ignore[misc]
            lambda p=p: stream(url, p, MAX_TOKENS, streaming=self.streaming, **kw) for p in batch
        ]

    def workload(self, seed: int = 2) -> list[list[int]]:
        return prompts(self.ctx.scale.load_requests, seed)

    def busy(self, timeout_s: float = 60.0) -> None:
        """Wait until half the clients' requests are in the engine at once (mid-batch): as
        the clients see it (streaming: the moment the half-th starts, even if the waiter
        wakes after some ended), or as /health counts them (running, or queued behind the
        blocks a running one is computing: a prompt sharing them waits for them, then
        hits). Streams of the run's earlier batches do not count."""
        half = self.clients // 2
        self.streaming.mark()

        def in_engine() -> bool:
            if self.streaming.wait_for(half, 0.01):
                return True
            health = self.server.health()
            return health.get("running", 0) + health.get("waiting", 0) >= half

        if wait_until(in_engine, timeout_s, interval_s=0.0) is None:
            raise RuntimeError(f"{half} requests were never in the engine at once: no fault")

    def probe_until_ok(self, timeout_s: float = 60.0) -> float | None:
        """Seconds until /health says ok again, sending a new prompt every poll (a breaker
        closes only on a call that succeeds)."""
        fresh = iter(prompts(2000, seed=99))

        def ok() -> bool:
            stream(self.server.url, next(fresh), 1)
            return self.server.health().get("status") == "ok"

        return wait_until(ok, timeout_s)

    def finish(
        self, name: str, injected: str, answers: list[Answer], stopped: bool = False, **kw
    ) -> LoadOutcome:
        leaked, explained = None, False
        if not stopped:
            wait_until(lambda: self.server.held_blocks() == 0, 10.0)
            leaked = self.server.held_blocks()
            m = self.server.metrics()
            explained = self.may_evict and any(
                m.get(f'kvstore_store_{k}_total{{tier="lmdb"}}', 0.0)
                for k in ("evictions", "dropped_writes")
            )
        integrity_ok, held_at_close, _ = self.server.shut_down()
        lost, lost_note = self.lost_entries(answers, explained)
        checks = Checks(
            leaked_blocks=leaked,
            integrity_ok=integrity_ok and held_at_close == 0,
            lost_entries=lost,
            lost_note=lost_note,
        )
        return tally(self.ctx.model, self.base, answers, checks, name=name, injected=injected, **kw)

    def lost_entries(self, answers: list[Answer], explained: bool) -> tuple[int | None, str]:
        """Answered prompts that a fresh server on the same LMDB (no Redis) cannot hit in
        full; None when LMDB evicted or dropped entries (`explained`: they explain misses)."""
        done = {(tuple(a.prompt), a.key) for a in answers if a.ok}
        fresh = LiveServer(self.ctx, self.tag, redis=False).start().wait_ready()
        try:
            short = fresh.misses(done)
        finally:
            fresh.shut_down()
        note = f"{len(done) - short}/{len(done)} answered prompts hit in full from LMDB after"
        return (None if short and explained else short), note


# ----------------------------------------------------------------------------- scenarios


def redis_fault(ctx: Context, kill: bool) -> LoadOutcome:
    """The workload with Redis SIGKILLed (restarted empty) or SIGSTOPped mid-batch for
    `outage_s`; recovery runs to /health ok (the breaker closed on a probe)."""
    how = ("SIGKILLed", "SIGKILL", "restart") if kill else ("SIGSTOPped", "SIGSTOP", "SIGCONT")
    stop, start = (
        (ctx.redis.kill, ctx.redis.restart) if kill else (ctx.redis.pause, ctx.redis.resume)
    )
    run = Run(ctx, "redis-kill" if kill else "redis-stop")
    recovery: list[float | None] = []

    def fault() -> None:
        run.busy()
        stop()
        time.sleep(ctx.scale.outage_s)
        start()
        recovery.append(run.probe_until_ok())

    answers = run_clients(run.jobs(run.workload()), run.clients, during=fault)
    return run.finish(
        name=f"Redis {how[0]} mid-batch",
        injected=f"{run.clients} streaming clients; {how[1]} Redis with half of them running "
        f"for {ctx.scale.outage_s:g} s, then {how[2]}",
        answers=answers,
        recovery_s=recovery[0],
        note=f"recovery = {how[2]} to /health ok (breaker closed)",
    )


def redis_killed(ctx: Context) -> LoadOutcome:
    return redis_fault(ctx, kill=True)


def redis_paused(ctx: Context) -> LoadOutcome:
    return redis_fault(ctx, kill=False)


def lmdb_map_full(ctx: Context) -> LoadOutcome:
    map_gb = str(0.25 * 2**20 / 2**30)  # 256 KiB, the minimum
    run = Run(ctx, "lmdb-full", "--lmdb-map-size-gb", map_gb, redis=False, may_evict=True)
    answers = run_clients(run.jobs(run.workload()), run.clients)
    stats = run.server.metrics()
    figures = {
        k: stats.get(f'kvstore_store_{k}_total{{tier="lmdb"}}', 0.0)
        for k in ("writes", "evictions", "dropped_writes", "errors")
    }
    return run.finish(
        name="LMDB map full under a batch",
        injected=f"{run.clients} streaming clients writing to a 256 KiB LMDB map",
        answers=answers,
        figures=figures,
        note=", ".join(f"{int(v)} {k.replace('_', ' ')}" for k, v in figures.items()),
    )


def preemption(ctx: Context) -> LoadOutcome:
    blocks = PREFIX_BLOCKS + OWN_BLOCKS + MAX_TOKENS // BS + 2  # one request and a bit
    run = Run(ctx, "preempt", "--device-blocks", str(3 * blocks))
    answers = run_clients(run.jobs(run.workload()), run.clients)
    preempted = run.server.metrics().get("kvstore_preemptions_total", 0.0)
    return run.finish(
        name="preemption storm",
        injected=f"{run.clients} streaming clients on a pool of {3 * blocks} blocks ({blocks} "
        "hold one request)",
        answers=answers,
        figures={"preemptions": preempted},
        note=f"{int(preempted)} preemptions",
    )


def disconnects(ctx: Context) -> LoadOutcome:
    run = Run(ctx, "disconnect")
    rng = random.Random(7)
    batch = run.workload()
    leaving = set(rng.sample(range(len(batch)), round(0.3 * len(batch))))
    leave = [rng.randint(1, MAX_TOKENS // 2) if i in leaving else None for i in range(len(batch))]
    url = run.server.url
    jobs = [
        lambda p=p, k=k: stream(url, p, MAX_TOKENS, leave_after=k)
        for p, k in zip(batch, leave, strict=True)
    ]
    answers = run_clients(jobs, run.clients)
    left = sum(k is not None for k in leave)
    return run.finish(
        name="clients leave mid-stream",
        injected=f"{run.clients} streaming clients; {left} of {len(batch)} requests disconnect "
        "after a random number of chunks",
        answers=answers,
    )


BAD_BODIES = (
    b"{not json",
    b'{"model": "micro", "prompt": [1, 2, 3], "max_tokens": "many"}',
    b'{"model": "micro", "prompt": [999999], "max_tokens": 2}',
    b'{"model": "micro", "prompt": "' + b"x" * 70_000 + b'", "max_tokens": 2}',
)


def bad_input(ctx: Context) -> LoadOutcome:
    run = Run(ctx, "bad-input", "--max-body-bytes", "65536")
    batch, url = run.workload(), run.server.url
    bad = [BAD_BODIES[i % len(BAD_BODIES)] for i in range(len(batch) // 4)]
    jobs = run.jobs(batch) + [lambda b=b: stream(url, [], 0, payload=b) for b in bad]
    random.Random(3).shuffle(jobs)
    answers = run_clients(jobs, run.clients)
    statuses = Counter(a.status for a in answers if a.prompt == [])
    return run.finish(
        name="bad requests in a healthy batch",
        injected=f"{run.clients} streaming clients; {len(bad)} malformed, mistyped, "
        f"out-of-range and oversized bodies shuffled among {len(batch)} good requests",
        answers=answers,
        note="bad ones: " + ", ".join(f"{n}x {s}" for s, n in sorted(statuses.items())),
    )


def sigterm(ctx: Context) -> LoadOutcome:
    run = Run(ctx, "sigterm")
    exit_s: list[float] = []
    started: list[float] = []

    def fault() -> None:
        run.busy()
        started.append(time.perf_counter())
        run.server.proc.terminate()
        run.server.proc.wait(60)
        exit_s.append(time.perf_counter() - started[0])

    answers = run_clients(run.jobs(run.workload()), run.clients, during=fault)
    for a in answers:  # sent after SIGTERM, not taken in: the listener closed before it
        if a.status is None and a.sent_at >= started[0]:
            a.error = "closed"
    return run.finish(
        name="SIGTERM with requests in flight",
        injected=f"{run.clients} streaming clients; SIGTERM with half of them running (drain "
        "timeout 30 s)",
        answers=answers,
        stopped=True,
        recovery_s=exit_s[0],
        figures={"exit_s": exit_s[0]},
        note=f"exited {exit_s[0]:.1f} s after SIGTERM (bound 30 s); sent after it: 503 "
        "draining, or closed unread once the listener closed (no byte answered: safe to retry)",
    )


def disk_full(ctx: Context) -> LoadOutcome | None:
    with small_tmpfs(ctx.workdir / "lmdb-disk-full") as ready:
        if not ready:
            return None
        map_gb = str(4 * 2**20 / 2**30)  # a 4 MiB map on a 1 MiB disk
        run = Run(ctx, "disk-full", "--lmdb-map-size-gb", map_gb, redis=False, may_evict=True)
        answers = run_clients(run.jobs(run.workload()), run.clients)
        state = run.server.health().get("tiers", {}).get("lmdb", {}).get("state")
        m = run.server.metrics()
        figures = {
            k: m.get(f'kvstore_store_{k}_total{{tier="lmdb"}}', 0.0)
            for k in ("writes", "dropped_writes", "errors")
        }
        logged = "tier lmdb is failing" in run.server.log_tail(200_000)
        return run.finish(
            name="disk full under LMDB",
            injected=f"{run.clients} streaming clients; LMDB map 4 MiB on a 1 MiB tmpfs",
            answers=answers,
            figures=figures,
            note=f"/health showed lmdb {state!r}, the log {'said' if logged else 'did NOT say'}"
            " so; " + ", ".join(f"{int(v)} {k.replace('_', ' ')}" for k, v in figures.items()),
        )


FLOOD_QUEUE = 4  # the flood scenario's --max-queue
FLOOD_EXTRA = 8  # b's requests sent again at most, should none have met a's queue full


class Flood:
    """`n` clients of tenant a sending requests back to back until stopped."""

    def __init__(self, url: str, n: int):
        self.url, self.answers, self.stop = url, [], threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(n)]

    def __enter__(self) -> Flood:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _client(self, i: int) -> None:
        batch = prompts(16, seed=600 + i)
        while not self.stop.is_set():
            self.answers.append(stream(self.url, batch[len(self.answers) % 16], MAX_TOKENS))


def tenant_flood(ctx: Context) -> LoadOutcome:
    """Tenant a floods (4x the clients against a queue bound of 4) while tenant b sends
    requests on 2 clients: b's TTFT against b alone, and whether b is ever refused."""
    run = Run(ctx, "flood", "--max-queue", str(FLOOD_QUEUE), "--max-num-seqs", "4")
    url, quiet = run.server.url, prompts(ctx.scale.load_requests // 2, seed=5)
    b_jobs = [lambda p=p: stream(url, p, MAX_TOKENS, key="sk-load-b") for p in quiet]
    run.base = run_clients(b_jobs[:4], 1)  # b alone

    def queue_full() -> bool:
        return run.server.health().get("waiting", 0) >= FLOOD_QUEUE

    def b_when_full(job: Callable[[], Answer]) -> Answer:
        wait_until(queue_full, 5.0)  # b meets the bound (a flood keeps it full, mostly)
        return job()

    def displaced_now() -> float:
        return run.server.metrics().get("kvstore_requests_displaced_total", 0.0)

    with Flood(url, 4 * run.clients) as flood:
        if wait_until(queue_full, 30.0) is None:
            raise RuntimeError("the flood never filled the queue")
        mine = run_clients([lambda j=j: b_when_full(j) for j in b_jobs], 2)
        for job in b_jobs[:FLOOD_EXTRA]:  # every b request found a gap in a's queue: b
            if displaced_now():  # sends more (each must be served) until one meets it full
                break
            mine.append(b_when_full(job))
    displaced = displaced_now()
    theirs = flood.answers
    outcome = run.finish(
        name="one tenant floods",
        injected=f"tenant a: {4 * run.clients} clients back to back, queue bound {FLOOD_QUEUE}; "
        f"tenant b: {len(quiet)} requests on 2 clients meanwhile",
        answers=mine + theirs,
    )
    b_refused = sum(not a.ok for a in mine)
    b_ttft = [a.ttft_s for a in mine if a.ok and a.ttft_s is not None]
    outcome.ttft_p50_ms, outcome.ttft_p99_ms = percentile_ms(b_ttft, 50), percentile_ms(b_ttft, 99)
    outcome.note = (
        f"tenant b: {len(mine) - b_refused}/{len(mine)} served, TTFT is b's "
        f"(baseline: b alone); tenant a: {sum(a.ok for a in theirs)}/{len(theirs)} "
        f"served, {int(displaced)} of its waiting requests displaced; " + outcome.note
    )
    outcome.figures |= {"b_refused": b_refused, "displaced": displaced}
    return outcome


SCENARIOS: dict[str, Callable[[Context], LoadOutcome | None]] = {
    "load-redis-kill": redis_killed,
    "load-redis-stop": redis_paused,
    "load-lmdb-full": lmdb_map_full,
    "load-preempt": preemption,
    "load-disconnect": disconnects,
    "load-bad-input": bad_input,
    "load-sigterm": sigterm,
    "load-disk-full": disk_full,
    "load-flood": tenant_flood,
}
