"""Helpers of the adapter tests: import a stack, tier settings, corrupt a stored block, read
the adapter counters.

A stack's tests import the stack with `import_stack`: without it they skip, unless
KVSTORE_REQUIRE_STACKS names it (CI: each stack's venv sets it), where they fail instead.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from kvstore.adapters.blocks import BlockStore


def import_stack(stack: str, module: str) -> ModuleType:
    """`module` of `stack`, or skip (fail when KVSTORE_REQUIRE_STACKS lists `stack`)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        required = os.environ.get("KVSTORE_REQUIRE_STACKS", "").split(",")
        if stack in required:
            pytest.fail(f"{stack} is required (KVSTORE_REQUIRE_STACKS) but: {e}")
        pytest.skip(
            f"{stack} is not installed (pip install -e '.[{stack}]'): {e}",
            allow_module_level=True,
        )


def tier_settings(name: str, tmp_path: Path, redis_server: Any = None) -> dict[str, Any]:
    if name == "memory":
        return {"memory_cache_gb": 0.01}
    if name == "lmdb":
        return {"lmdb_dir": str(tmp_path / "lmdb"), "lmdb_map_size_gb": 0.01}
    return {"redis_url": redis_server.url, "breaker_failures": 1, "breaker_cooldown_s": 0.2,
            "lookup_deadline_ms": 500.0}  # fmt: skip


def corrupt(blocks: BlockStore, stack_key: bytes, tier: int = 0) -> None:
    """Flip one payload bit of a stored block in one tier (its checksum no longer holds)."""
    store, key = blocks.stores[tier], blocks.hasher.key(stack_key)
    (value,) = store.get_many([key])
    assert value is not None, "the block to corrupt is not stored"
    damaged = bytearray(value)
    damaged[-20] ^= 0x01
    store.delete([key])
    assert store.put_many([(key, bytes(damaged))]) == 1


def count(blocks: BlockStore, name: str, **labels: str) -> int:
    return blocks.metrics.get(name, stack=blocks.stack, **labels)


def verify_failures(blocks: BlockStore, tier: str, reason: str) -> int:
    return blocks.metrics.get("verify_failures_total", tier=tier, reason=reason)


ROOT = Path(__file__).resolve().parents[2]
_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def compose_service(name: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a docker-compose.yml service, ${VAR:-default}
    interpolated with the defaults (as tests/server's Compose does)."""
    service = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"][name]

    def sub(value: object) -> str:
        return _VAR.sub(lambda m: m.group(2) or "", str(value))

    env = {k: sub(v) for k, v in (service.get("environment") or {}).items()}
    return [sub(a) for a in service["command"]], env


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def compose_redis(redis_server_factory: Any, env: dict[str, str]) -> dict[str, str]:
    """Start a private Redis with the compose Redis's password; returns the service's
    environment with KVSTORE_REDIS_URL moved to it (only the host and port change)."""
    url = env["KVSTORE_REDIS_URL"]
    password = url.split("://:", 1)[1].split("@", 1)[0]
    server = redis_server_factory("--requirepass", password, password=password)
    assert "@redis:6379/" in url, url
    return {**env, "KVSTORE_REDIS_URL": url.replace("@redis:6379/", f"@127.0.0.1:{server.port}/")}
