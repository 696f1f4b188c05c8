"""Servers as subprocesses on loopback, for benchmarks and tests.

- `free_port`: a free loopback port (and its cluster bus port, +10000, when asked).
- `ServerProcess`: an HTTP server command (`kvstore serve`, `transformers serve`) in its own
  process group, ready when its /health answers 200, stopped group-wide (SIGTERM, then SIGKILL).
- `RedisServer`: a private redis-server (no persistence unless its arguments say otherwise),
  ready when it answers PING; tests and fault scenarios may pause, SIGKILL and restart it on
  the same port.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import weakref
from pathlib import Path
from urllib.parse import quote

import httpx
import redis

__all__ = ["RedisServer", "ServerProcess", "find_redis_server", "free_port"]

READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0
REDIS_READY_TIMEOUT_S = 15.0
REDIS_STOP_TIMEOUT_S = 10.0


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# Parallel test workers (pytest-xdist `gwN`) draw ports from a range of their own, below
# the kernel's ephemeral range: a port one worker found free and has not bound yet is then
# never handed to a server of another worker.
WORKER_PORTS, WORKER_BASE_PORT = 2500, 10000


def _candidate_port() -> int:
    """A port to try: the kernel's pick, or under a test worker one of its own range."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit() and int(worker[2:]) < 4:
        first = WORKER_BASE_PORT + int(worker[2:]) * WORKER_PORTS
        return random.randrange(first, first + WORKER_PORTS)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _PortLedger:
    """The ports this process has handed out: a port is free only until a server binds it,
    so two calls before the first server starts (a server's HTTP, events and replay ports)
    must never return the same one."""

    def __init__(self) -> None:
        self._given: set[int] = set()
        self._lock = threading.Lock()

    def take(self, cluster_bus: bool) -> int:
        with self._lock:
            for _ in range(200):
                port = _candidate_port()
                ports = {port, port + 10000} if cluster_bus else {port}
                if ports & self._given or not all(p < 65536 and _port_free(p) for p in ports):
                    continue
                self._given |= ports
                return port
        raise RuntimeError("no free port (pair, for a cluster node) found")


_LEDGER = _PortLedger()


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port (and port + 10000 free too when `cluster_bus`), never one this
    process handed out before."""
    return _LEDGER.take(cluster_bus)


class ServerProcess:
    """One server subprocess, its own process group; `url` is its base URL on 127.0.0.1."""

    def __init__(
        self,
        args: list[str],
        port: int,
        log_path: Path,
        env: dict[str, str],
        name: str = "kvstore serve",
        ready_timeout_s: float = READY_TIMEOUT_S,
    ):
        self.args, self.port, self.log_path, self.env = args, port, log_path, env
        self.name, self.ready_timeout_s = name, ready_timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own group: stop() reaches every child
            )
        # its own session outlives this process: a server nobody stopped (a run that failed
        # before its shutdown) goes with its handle, or at exit at the latest
        weakref.finalize(self, _kill_if_running, self.proc)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self) -> ServerProcess:
        """Poll /health until 200; RuntimeError with the log's tail if the process exits or
        `ready_timeout_s` passes first (the process is stopped then)."""
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline and self.alive():
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        why = "exited" if not self.alive() else f"not ready after {self.ready_timeout_s:.0f} s"
        self.stop()
        raise RuntimeError(
            f"{self.name} on port {self.port} did not start ({why}):\n{self.log_tail()}"
        )

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the group, SIGKILL after `timeout_s`; then SIGKILL to any straggler."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)  # children that outlived the leader

    def kill(self) -> None:
        """SIGKILL the whole group, no clean shutdown (a fault to survive), and reap it."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill_if_running(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGKILL)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def metric_series(text: str) -> dict[str, float]:
    """{series: value} of a Prometheus text page (comments skipped)."""
    rows = (line.rpartition(" ") for line in text.splitlines() if line[:1] != "#")
    return {series: float(value) for series, _, value in rows if series}


def by_label(series: dict[str, float], name: str) -> dict[str, float]:
    """The series of metric `name` (one label), by that label's value."""
    prefix = name + "{"
    return {k[len(prefix) :].split('"')[1]: v for k, v in series.items() if k.startswith(prefix)}


def find_redis_server(hint: str = "") -> str:
    """The redis-server executable; SystemExit (its message ending in `hint`) if missing."""
    path = shutil.which("redis-server")
    if path is None:
        raise SystemExit("redis-server is not installed" + hint)
    return path


class RedisServer:
    """One private redis-server process on 127.0.0.1, its files and `redis.log` in `workdir`;
    `url` connects to it. `extra_args` come last, so they override the defaults (no RDB
    snapshots, no AOF), e.g. `"--maxmemory", "1mb"` or `"--requirepass", "pw"` (then pass
    `password` so that `url` carries it). The port is chosen once: `restart` keeps it."""

    def __init__(
        self,
        workdir: Path,
        *extra_args: str,
        tls: dict[str, str] | None = None,
        cluster: bool = False,
        password: str | None = None,
        username: str | None = None,
        binary: str | None = None,
        config_file: Path | None = None,
    ):
        """`config_file` is read first (redis-server's own order); `extra_args` override it."""
        self.workdir = workdir
        self.config_file = config_file
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.binary = binary or find_redis_server()
        self.port = free_port(cluster_bus=cluster)
        self.extra_args, self.tls = extra_args, tls
        self.username, self.password = username, password
        self.log_path = workdir / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def url(self) -> str:
        auth = ""
        if self.password is not None:
            auth = f"{quote(self.username or '', safe='')}:{quote(self.password, safe='')}@"
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={quote(self.tls['ca'])}"

    def _args(self) -> list[str]:
        conf = [] if self.config_file is None else [str(self.config_file)]
        args = [self.binary, *conf, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--daemonize", "no"]  # fmt: skip
        if self.tls is None:
            args += ["--port", str(self.port)]
        else:
            args += ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", self.tls["cert"], "--tls-key-file", self.tls["key"],
                     "--tls-ca-cert-file", self.tls["ca"], "--tls-auth-clients", "no"]  # fmt: skip
        return args + list(self.extra_args)

    def client(self, **kwargs: object) -> redis.Redis:
        """A plain redis-py client for assertions and admin commands."""
        return redis.Redis.from_url(self.url, socket_timeout=5, **kwargs)

    def alive(self) -> bool:
        return self._running() is not None

    def _running(self) -> subprocess.Popen[bytes] | None:
        proc = self.proc
        return proc if proc is not None and proc.poll() is None else None

    def start(self) -> RedisServer:
        """Start and wait until it answers PING; RuntimeError with the log's tail if it exits
        or does not answer within REDIS_READY_TIMEOUT_S (it is stopped then)."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self._args(), stdout=log, stderr=subprocess.STDOUT)
        self.paused = False
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + REDIS_READY_TIMEOUT_S
        while time.monotonic() < deadline and self.alive():
            with (
                contextlib.suppress(redis.ConnectionError, redis.TimeoutError, OSError),
                self.client(socket_connect_timeout=0.5) as c,
            ):
                if c.ping():
                    return
            time.sleep(0.02)
        log = self.log_path.read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log}")

    def pause(self) -> None:
        """SIGSTOP: the socket still accepts connections, but nothing answers."""
        if (proc := self._running()) is not None:
            os.kill(proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        if (proc := self._running()) is not None:
            os.kill(proc.pid, signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        """SIGKILL (it is gone until `restart`; without persistence its data is lost)."""
        if (proc := self._running()) is not None:
            self.resume()
            proc.kill()
            proc.wait()
        self.paused = False

    def restart(self) -> None:
        """Kill (if running) and start again on the same port."""
        self.kill()
        self.start()

    def stop(self, timeout_s: float = REDIS_STOP_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`."""
        if (proc := self._running()) is None:
            return
        self.resume()
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
