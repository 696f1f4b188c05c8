"""Helpers for server tests: `kvstore serve` subprocesses on loopback, the compose file."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import httpx
import yaml

from bench.launch import ServerProcess as LaunchedServer
from bench.launch import free_port  # noqa: F401  (re-exported for the server tests)

ROOT = Path(__file__).resolve().parents[2]
TENANT_KEYS = {"sk-x-one": "x", "sk-x-two": "x", "sk-y": "y"}  # the keyed server's tenants
SERVED_NAME = "micro"
BLOCK_SIZE = 4  # the keyed server's block size
_VAR = re.compile(r"\$\$|\$\{(\w+)(?::-([^}]*))?\}")


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

    def config_content(self, name: str) -> str:
        """A top-level config's `content`, interpolated."""
        return substitute(self.data["configs"][name]["content"], self.env)

    def redis_password(self) -> str:
        """The `requirepass` of the config file the redis service reads."""
        lines = self.config_content("redis-auth").splitlines()
        return next(line.split(" ", 1)[1] for line in lines if line.startswith("requirepass "))


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


class ServerProcess(LaunchedServer):
    """One `kvstore serve` subprocess (bench.launch: own process group); `url` is its base URL."""

    def healthy(self) -> bool:
        return httpx.get(f"{self.url}/health", timeout=5.0).json()["status"] == "ok"

    def metrics(self, api_key: str | None = None) -> dict[str, float]:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        response = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10.0)
        response.raise_for_status()
        return parse_metrics(response.text)


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
