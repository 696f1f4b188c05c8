"""`load-router-kill`: 3 replicas behind `kvstore router`, streaming clients through the
router, one replica SIGKILLed mid-batch. A request that had not started streaming must not be
lost (the router retries it elsewhere); one whose stream the kill broke ends with the
router's error event, a documented refusal. Entries are checked in the shared Redis, which
every replica writes through.

`load-split-kill-prefill` / `load-split-kill-decode`: the same with a prefill replica and two
decode replicas (`--role`), the router handing every prompt over (`--handover-min-tokens 0`),
and the prefill replica (a decode replica) SIGKILLed with a request running: a prompt whose
prefill step it was running is prefilled by the decode replica itself, and no request is
lost."""

from __future__ import annotations

import os
import sys
import time

import httpx

from bench.faults.common import Context
from bench.faults.concurrent import prompts
from bench.faults.live import Answer, LiveServer, model_dir, run_clients, stream, wait_until
from bench.faults.load_report import MAX_TOKENS, Checks, LoadOutcome, tally
from bench.launch import ServerProcess, by_label, free_port, metric_series

REPLICAS = 3


def start_fleet(
    ctx: Context, roles: tuple[str, ...] = ("both",) * REPLICAS, *router_flags: str
) -> tuple[ServerProcess, list[LiveServer]]:
    replicas = [
        LiveServer(ctx, f"fleet-{i}", "--kv-events-port", str(free_port()),
                   "--kv-events-replay-port", str(free_port()), "--role", role).start()
        for i, role in enumerate(roles)
    ]  # fmt: skip
    for replica in replicas:
        replica.wait_ready()
    port = free_port()
    urls = [a for r in replicas for a in ("--replica", r.url)]
    args = [sys.executable, "-m", "engine.cli", "router", "--model", str(model_dir(ctx)),
            "--port", str(port), "--api-keys-file", str(ctx.workdir / "load-keys.json"),
            "--log-level", "warning", *urls, *router_flags]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    router = ServerProcess(
        args,
        port,
        log_path=ctx.workdir / "router.log",
        env={**env, "KVSTORE_SECRET": "load-secret"},
        name="kvstore router",
    )
    return router.start().wait_ready(), replicas


def redis_misses(ctx: Context, answers: list[Answer], dead: str) -> tuple[int, str]:
    """Prompts answered by a surviving replica that a fresh server reading only the shared
    Redis (an empty LMDB) cannot hit in full."""
    done = {(tuple(a.prompt), a.key) for a in answers if a.ok and a.replica != dead}
    fresh = LiveServer(ctx, "fleet-check").start().wait_ready()
    try:
        short = fresh.misses(done)
    finally:
        fresh.shut_down()
    return short, f"{len(done) - short}/{len(done)} survivors' prompts hit in full from Redis"


def router_replica_killed(ctx: Context) -> LoadOutcome:
    return replica_killed(ctx, ("both",) * REPLICAS, 0, "replica SIGKILLed behind the router")


def split_replica_killed(ctx: Context, role: str) -> LoadOutcome:
    roles = ("prefill", "decode", "decode")
    name = f"{role} replica SIGKILLed in a prefill/decode fleet"
    return replica_killed(ctx, roles, roles.index(role), name, "--handover-min-tokens", "0")


def replica_killed(
    ctx: Context, roles: tuple[str, ...], victim_index: int, name: str, *router_flags: str
) -> LoadOutcome:
    router, replicas = start_fleet(ctx, roles, *router_flags)
    victim, clients = replicas[victim_index], ctx.scale.load_clients
    warm_up = [lambda p=p: stream(router.url, p, MAX_TOKENS) for p in prompts(clients, seed=1)]
    base = run_clients(warm_up, clients)
    killed_at: list[float] = []

    def fault() -> None:
        wait_until(lambda: victim.health().get("running", 0) >= 1, 60.0)
        victim.kill()
        killed_at.append(time.perf_counter())

    batch = prompts(ctx.scale.load_requests, seed=2)
    jobs = [lambda p=p: stream(router.url, p, MAX_TOKENS) for p in batch]
    answers = run_clients(jobs, clients, during=fault)
    for a in answers:  # broken after its first byte: the router's documented error event
        if a.status == 200 and a.error == "server_error" and a.replica == victim.url:
            a.error = "broken mid-stream"
    survivors = [r for r in replicas if r is not victim]
    wait_until(lambda: all(r.held_blocks() == 0 for r in survivors), 10.0)
    leaked = sum(r.held_blocks() for r in survivors)
    closed = [r.shut_down() for r in survivors]
    handovers = handover_counts(router)
    router.stop()
    lost, note = redis_misses(ctx, answers, victim.url)
    broken = sum(a.error == "broken mid-stream" for a in answers)
    checks = Checks(
        leaked_blocks=leaked,
        integrity_ok=all(ok and held == 0 for ok, held, _ in closed),
        lost_entries=lost,
        lost_note=note,
    )
    return tally(
        ctx.model,
        base,
        answers,
        checks,
        name=name,
        injected=f"{clients} streaming clients through `kvstore router` to {len(roles)} "
        f"replicas ({', '.join(roles)}); SIGKILL replica {victim_index} "
        f"({roles[victim_index]}) with a request running",
        note=f"{broken} streams broken after their first byte (the router's error event, "
        f"counted as refused: the client must retry); every other request answered{handovers}",
        figures={"broken": broken},
    )


def handover_counts(router: ServerProcess) -> str:
    """The router's hand-over outcomes, as a note ("" when it paired no replicas)."""
    page = metric_series(httpx.get(f"{router.url}/metrics", timeout=10.0).text)
    found = by_label(page, "kvstore_router_handovers_total")
    if not any(found.values()):
        return ""
    counts = ", ".join(f"{found.get(k, 0):.0f} {k.replace('_', ' ')}"
                       for k in ("handed_over", "fallback", "direct"))  # fmt: skip
    return f"; prompts: {counts}"
