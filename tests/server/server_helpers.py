"""Helpers for server tests: `kvstore serve` subprocesses on loopback, the compose file."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 90.0
TENANT_KEYS = {"sk-x-one": "x", "sk-x-two": "x", "sk-y": "y"}  # the keyed server's tenants
SERVED_NAME = "micro"
BLOCK_SIZE = 4  # the keyed server's block size
_VAR = re.compile(r"\$\$|\$\{(\w+)(?::-([^}]*))?\}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvstore_script() -> str:
    return str(Path(sys.executable).with_name("kvstore"))


def substitute(text: str, env: dict[str, str]) -> str:
    """Compose interpolation: ${VAR}, ${VAR:-default} and $$."""

    def value(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1)) or (m.group(2) or "")

    return _VAR.sub(value, text)


class Compose:
    """docker-compose.yml, interpolated with an empty environment (the documented defaults)."""

    def __init__(self, path: Path = ROOT / "docker-compose.yml", env: dict | None = None):
        self.data = yaml.safe_load(path.read_text())
        self.env = env or {}

    @property
    def services(self) -> dict[str, dict]:
        return self.data["services"]

    def command(self, service: str) -> list[str]:
        return [substitute(str(a), self.env) for a in self.services[service]["command"]]

    def environment(self, service: str) -> dict[str, str]:
        env = self.services[service].get("environment") or {}
        return {k: substitute(str(v), self.env) for k, v in env.items()}


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def replace_flag(args: list[str], flag: str, value: str) -> list[str]:
    """A copy of args with the value after `flag` replaced (the flag must be there)."""
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return {**env, **extra}


class ServerProcess:
    """One `kvstore serve` subprocess; `url` is its base URL."""

    def __init__(self, args: list[str], port: int, log_path: Path, env: dict[str, str]):
        self.args, self.port, self.log_path, self.env = args, port, log_path, env
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
        return self

    def wait_ready(self) -> ServerProcess:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                break
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        log = self.log_path.read_text(errors="replace")[-3000:]
        self.stop()
        raise RuntimeError(f"kvstore serve on port {self.port} did not start:\n{log}")

    def healthy(self) -> bool:
        return httpx.get(f"{self.url}/health", timeout=5.0).json()["status"] == "ok"

    def metrics(self, api_key: str | None = None) -> dict[str, float]:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        response = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10.0)
        response.raise_for_status()
        return parse_metrics(response.text)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def parse_metrics(text: str) -> dict[str, float]:
    """{series: value} of a Prometheus text page (comments skipped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.05) -> None:
    """Poll until predicate() is true (a condition, never a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(interval_s)
