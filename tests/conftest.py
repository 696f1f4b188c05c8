"""Shared fixtures: private, real redis-server processes (single, cluster, TLS).

Without a `redis-server` binary these fixtures skip the test, unless KVSTORE_REQUIRE_REDIS=1,
in which case they fail it (CI sets it so that Redis tests cannot silently vanish).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

READY_TIMEOUT_S = 15.0


def skip_or_fail(message: str) -> None:
    """Skip a test that lacks a service, or fail it under KVSTORE_REQUIRE_REDIS=1 (CI)."""
    if os.environ.get("KVSTORE_REQUIRE_REDIS") == "1":
        pytest.fail(message + "; KVSTORE_REQUIRE_REDIS=1 requires it")
    pytest.skip(message)


def require_binary(name: str) -> str:
    """Path of an executable; skip (or fail under KVSTORE_REQUIRE_REDIS=1) when missing."""
    path = shutil.which(name)
    if path is None:
        skip_or_fail(f"{name} is not installed (install the redis-server package)")
    return path


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port (and port + 10000 free too when `cluster_bus`)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster_bus or (port + 10000 < 65536 and _port_free(port + 10000)):
            return port
    raise RuntimeError("no free port pair found for a cluster node")


class RedisServer:
    """One private redis-server process on 127.0.0.1. `url` connects to it."""

    def __init__(
        self,
        workdir: Path,
        *extra_args: str,
        tls: dict[str, str] | None = None,
        cluster: bool = False,
        password: str | None = None,
        username: str | None = None,
        config_file: Path | None = None,
    ):
        """`config_file` is read first (redis-server's own order); `extra_args` override it."""
        self.workdir = workdir
        self.config_file = config_file
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port(cluster_bus=cluster)
        self.extra_args = extra_args
        self.tls = tls
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
        args = [require_binary("redis-server"), *conf, "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no"]  # fmt: skip
        if self.tls is None:
            args += ["--port", str(self.port)]
        else:
            args += ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", self.tls["cert"], "--tls-key-file", self.tls["key"],
                     "--tls-ca-cert-file", self.tls["ca"], "--tls-auth-clients", "no"]  # fmt: skip
        return args + list(self.extra_args)

    def client(self, **kwargs: object) -> redis.Redis:
        """A plain redis-py client for test assertions and admin commands."""
        return redis.Redis.from_url(self.url, socket_timeout=5, **kwargs)

    def start(self) -> RedisServer:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self._args(), stdout=log, stderr=subprocess.STDOUT)
        self.paused = False
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                break
            try:
                with self.client(socket_connect_timeout=0.5) as c:
                    if c.ping():
                        return
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                time.sleep(0.02)
        log = self.log_path.read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log}")

    def kill(self) -> None:
        """SIGKILL the server (it is gone until `restart`)."""
        if self.proc is not None and self.proc.poll() is None:
            if self.paused:
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
        self.paused = False

    def restart(self) -> None:
        """Kill (if running) and start again on the same port, empty."""
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the socket still accepts connections, but nothing answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        if self.paused:
            self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start extra private servers: `factory("--maxmemory", "1mb", password="pw")`."""
    servers: list[RedisServer] = []

    def start(*extra_args: str, **kwargs: object) -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(servers)}", *extra_args, **kwargs)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A fresh, empty redis-server for this test (kill/restart/pause it freely)."""
    return redis_server_factory()


class RedisClusterNodes:
    """Three master nodes, all slots assigned, no replicas."""

    def __init__(self, nodes: list[RedisServer]):
        self.nodes = nodes

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.nodes[0].port, socket_timeout=5)


def _wait_cluster_ok(nodes: list[RedisServer]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        states = []
        for node in nodes:
            with node.client() as c:
                states.append(c.cluster("INFO").get("cluster_state"))
        if states == ["ok"] * len(nodes):
            return
        time.sleep(0.05)
    raise RuntimeError("redis cluster did not reach cluster_state:ok")


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    """A 3-master Redis Cluster, shared by the session: use distinct key namespaces."""
    cli = require_binary("redis-cli")
    base = tmp_path_factory.mktemp("redis-cluster")
    nodes = []
    for i in range(3):
        conf = f"nodes-{i}.conf"
        args = ("--cluster-enabled", "yes", "--cluster-config-file", conf)
        nodes.append(RedisServer(base / f"node-{i}", *args, cluster=True))
    try:
        for node in nodes:
            node.start()
        addrs = [f"127.0.0.1:{node.port}" for node in nodes]
        create = [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run(create, check=True, capture_output=True, timeout=60)
        _wait_cluster_ok(nodes)
        yield RedisClusterNodes(nodes)
    finally:
        for node in nodes:
            node.stop()


def _make_certs(directory: Path) -> dict[str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost."""
    openssl = shutil.which("openssl")
    if openssl is None:
        skip_or_fail("openssl is not installed (needed to make TLS certificates)")
    d = directory
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    commands = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
         "-days", "2", "-subj", "/CN=kvstore-test-ca"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
         "-subj", "/CN=localhost"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.cnf"],
    ]  # fmt: skip
    for command in commands:
        subprocess.run([openssl, *command], cwd=d, check=True, capture_output=True, timeout=60)
    return {"ca": str(d / "ca.crt"), "cert": str(d / "server.crt"), "key": str(d / "server.key")}


@pytest.fixture(scope="session")
def redis_tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A TLS-only redis-server (port 0, tls-port); `.url` is rediss://...?ssl_ca_certs=<CA>."""
    require_binary("redis-server")
    base = tmp_path_factory.mktemp("redis-tls")
    server = RedisServer(base / "server", tls=_make_certs(base))
    try:
        server.start()
    except RuntimeError as e:
        if "TLS" in str(e) or "tls" in str(e):
            skip_or_fail(f"this redis-server has no TLS support: {e}")
        raise
    yield server
    server.stop()
