"""A fleet on loopback for `bench fleet`: N `kvstore serve` replicas publishing KV events,
optionally one shared redis-server, and `kvstore router` in front; all stopped on exit."""

from __future__ import annotations

import os
import re
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.launch import RedisServer, ServerProcess, find_redis_server, free_port
from bench.load.servers import kvstore_command, kvstore_env

READY_TIMEOUT_S = 240.0  # several replicas load at once on 2 cores
HITS = re.compile(r'^kvstore_prefix_cache_hits_tokens_total\{tier="(\w+)"\} ([0-9.e+]+)$', re.M)


@dataclass(frozen=True)
class FleetSpec:
    """What one run of the fleet is made of."""

    model_dir: Path
    replicas: int
    device_blocks: int
    shared: bool  # one Redis for all replicas; else each replica has its own LMDB
    route: str  # the router's --policy; "kv-device": kv, priced by device events alone
    workdir: Path
    memory_cache_gb: float | None = None  # a private host-memory tier instead of LMDB
    prefill_weight: float | None = None
    decode_weight: float | None = None
    roles: tuple[str, ...] = ()  # each replica's --role (empty: all `both`)
    pin_cores: bool = False  # replica i on core i (mod the cores), by taskset
    handover_min_tokens: int | None = None  # the router's, when set

    def role(self, i: int) -> str:
        return self.roles[i] if self.roles else "both"


def _env() -> dict[str, str]:
    """One thread per replica (N replicas share the cores); no KVSTORE_* of the caller's."""
    threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "0"}
    return kvstore_env() | threads


def replica_command(spec: FleetSpec, port: int, events: int, tier: list[str], i: int = 0) -> list:
    """`bench load`'s kvstore command, publishing its KV events, over its tier, in its role
    (pinned to a core of its own when the spec asks and taskset exists)."""
    events_flags = ["--kv-events-port", str(events), "--kv-events-replay-port", str(free_port())]
    command = [*kvstore_command(spec.model_dir, port, spec.device_blocks), *events_flags, *tier]
    command += ["--role", spec.role(i)]
    return [*pinned(i), *command] if spec.pin_cores else command


def pinned(i: int) -> list[str]:
    """`taskset -c CORE` for replica i (CORE: the i-th of this process's cores, round
    robin); empty where taskset is missing."""
    if shutil.which("taskset") is None:
        return []
    cores = sorted(os.sched_getaffinity(0))
    return ["taskset", "-c", str(cores[i % len(cores)])]


def router_command(spec: FleetSpec, port: int, replicas: list[str]) -> list:
    weights = []
    if spec.prefill_weight is not None:
        weights += ["--prefill-weight", str(spec.prefill_weight)]
    if spec.decode_weight is not None:
        weights += ["--decode-weight", str(spec.decode_weight)]
    if spec.route == "kv-device":
        weights.append("--device-events-only")
    if spec.handover_min_tokens is not None:
        weights += ["--handover-min-tokens", str(spec.handover_min_tokens)]
    urls = [arg for url in replicas for arg in ("--replica", url)]
    policy = "kv" if spec.route == "kv-device" else spec.route
    return [sys.executable, "-m", "engine.cli", "router", "--model", str(spec.model_dir),
            "--port", str(port), "--policy", policy, "--log-level", "warning",
            *urls, *weights]  # fmt: skip


class Fleet:
    """The processes of one run; `with Fleet(spec) as fleet:` starts them and waits."""

    def __init__(self, spec: FleetSpec):
        self.spec = spec
        self.redis: RedisServer | None = None
        self.replicas: list[ServerProcess] = []
        self.router: ServerProcess | None = None
        self.killed: list[int] = []

    def _tier(self, i: int) -> list[str]:
        if self.redis is not None:
            return ["--redis-url", self.redis.url]
        if self.spec.memory_cache_gb is not None:
            return ["--memory-cache-gb", str(self.spec.memory_cache_gb)]
        return ["--lmdb-dir", str(self.spec.workdir / f"lmdb-{i}")]

    def start(self) -> Fleet:
        spec, env = self.spec, _env()
        spec.workdir.mkdir(parents=True, exist_ok=True)
        if spec.shared:
            find_redis_server(" (bench fleet's shared tier needs it)")
            self.redis = RedisServer(spec.workdir / "redis").start()
        for i in range(spec.replicas):
            port, events = free_port(), free_port()
            args = replica_command(spec, port, events, self._tier(i), i)
            log = spec.workdir / f"replica-{i}.log"
            proc = ServerProcess(args, port, log, env, f"replica {i}", READY_TIMEOUT_S)
            self.replicas.append(proc.start())
        for proc in self.replicas:
            proc.wait_ready()
        port = free_port()
        args = router_command(spec, port, [p.url for p in self.replicas])
        log = spec.workdir / "router.log"
        self.router = ServerProcess(args, port, log, env, "kvstore router", READY_TIMEOUT_S)
        self.router.start().wait_ready()
        return self

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def kill(self, i: int) -> None:
        """SIGKILL replica i's process group (no clean shutdown)."""
        self.replicas[i].kill()
        self.killed.append(i)

    def tier_hits(self) -> dict[str, float]:
        """Cached prompt tokens by tier, summed over the live replicas' /metrics."""
        total: dict[str, float] = {}
        for i, proc in enumerate(self.replicas):
            if i in self.killed:
                continue
            page = httpx.get(f"{proc.url}/metrics", timeout=10.0).text
            for tier, value in HITS.findall(page):
                total[tier] = total.get(tier, 0.0) + float(value)
        return total

    def metrics(self, i: int | None = None) -> str:
        """Replica i's /metrics page (None: the router's)."""
        url = self.url if i is None else self.replicas[i].url
        return httpx.get(f"{url}/metrics", timeout=10.0).text

    def routed(self) -> list[int]:
        body = httpx.get(f"{self.url}/health", timeout=10.0).json()
        return [r["routed"] for r in body["replicas"]]

    def stop(self) -> None:
        for proc in [self.router, *self.replicas]:
            if proc is not None:
                proc.stop()
        if self.redis is not None:
            self.redis.stop()

    def __enter__(self) -> Fleet:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Killer:
    """SIGKILLs replica `victim` (None: none) `delay_s` after a third of `total` requests
    finished, from a thread of its own (the client thread that tripped it goes on at once)."""

    def __init__(self, fleet: Fleet, victim: int | None, total: int, delay_s: float = 0.0):
        self.fleet, self.victim, self.delay_s = fleet, victim, delay_s
        self.at, self.count = max(1, total // 3), 0
        self.lock = threading.Lock()

    def done(self) -> None:
        with self.lock:
            self.count += 1
            if self.victim is None or self.count != self.at:
                return
        timer = threading.Timer(self.delay_s, self.fleet.kill, args=(self.victim,))
        timer.daemon = True
        timer.start()


class Tick:
    """A progress bar's `update` that also tells the killer a request finished."""

    def __init__(self, bar, killer: Killer):
        self.bar, self.killer = bar, killer

    def update(self, n: int) -> None:
        self.bar.update(n)
        self.killer.done()
