"""A private redis-server on a free loopback port, for benchmarks (no persistence)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import redis


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A redis-server on a free loopback port, without persistence, stopped on exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed: install it or pass --redis-url")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-io-redis-") as workdir:
        args = [binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", workdir]
        args += ["--save", "", "--appendonly", "no"]  # no persistence
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            wait_ready(url, proc)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and proc.poll() is None:
        with (
            contextlib.suppress(redis.ConnectionError, redis.TimeoutError, OSError),
            redis.Redis.from_url(url, socket_connect_timeout=0.5) as client,
        ):
            if client.ping():
                return
        time.sleep(0.05)
    raise RuntimeError(f"redis-server at {url} did not start")
