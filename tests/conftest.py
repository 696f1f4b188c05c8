"""Shared fixtures: private, real redis-server processes (single, cluster, TLS), each a
`bench.launch.RedisServer` (the launcher the benchmarks use too).

Without a `redis-server` binary these fixtures skip the test, unless KVSTORE_REQUIRE_REDIS=1,
in which case they fail it (CI sets it so that Redis tests cannot silently vanish).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from bench.launch import REDIS_READY_TIMEOUT_S, RedisServer

if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n 2`: two workers share the cores
    import torch

    torch.set_num_threads(1)


def skip_or_fail(message: str) -> None:
    """Skip a test that lacks a service, or fail it under KVSTORE_REQUIRE_REDIS=1 (CI)."""
    if os.environ.get("KVSTORE_REQUIRE_REDIS") == "1":
        pytest.fail(message + "; KVSTORE_REQUIRE_REDIS=1 requires it")
    pytest.skip(message)


@pytest.fixture(name="skip_or_fail")
def skip_or_fail_fixture():
    """`skip_or_fail` for test files below this one (a conftest is not imported by name)."""
    return skip_or_fail


def require_binary(name: str) -> str:
    """Path of an executable; skip (or fail under KVSTORE_REQUIRE_REDIS=1) when missing."""
    path = shutil.which(name)
    if path is None:
        skip_or_fail(f"{name} is not installed (install the redis-server package)")
    return path


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start extra private servers: `factory("--maxmemory", "1mb", password="pw")`."""
    servers: list[RedisServer] = []

    def start(*extra_args: str, **kwargs: object) -> RedisServer:
        workdir, binary = tmp_path / f"redis-{len(servers)}", require_binary("redis-server")
        server = RedisServer(workdir, *extra_args, binary=binary, **kwargs)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private redis-server for one test module (under a fleet the module starts once)."""
    workdir, binary = tmp_path_factory.mktemp("redis"), require_binary("redis-server")
    server = RedisServer(workdir, binary=binary).start()
    yield server
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
    deadline = time.monotonic() + REDIS_READY_TIMEOUT_S
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
    cli, binary = require_binary("redis-cli"), require_binary("redis-server")
    base = tmp_path_factory.mktemp("redis-cluster")
    nodes = []
    for i in range(3):
        conf = f"nodes-{i}.conf"
        args = ("--cluster-enabled", "yes", "--cluster-config-file", conf)
        nodes.append(RedisServer(base / f"node-{i}", *args, cluster=True, binary=binary))
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
    binary = require_binary("redis-server")
    base = tmp_path_factory.mktemp("redis-tls")
    server = RedisServer(base / "server", tls=_make_certs(base), binary=binary)
    try:
        server.start()
    except RuntimeError as e:
        if "TLS" in str(e) or "tls" in str(e):
            skip_or_fail(f"this redis-server has no TLS support: {e}")
        raise
    yield server
    server.stop()


@pytest.fixture(params=["memory", "lmdb", "redis"])
def tier(request: pytest.FixtureRequest) -> str:
    """Each spill tier in turn (a module or folder with a `tier` of its own overrides it)."""
    return request.param


@pytest.fixture
def redis_url(tier: str, request: pytest.FixtureRequest) -> str | None:
    """The private redis-server's URL when `tier` is redis, else None."""
    return request.getfixturevalue("redis_server").url if tier == "redis" else None
