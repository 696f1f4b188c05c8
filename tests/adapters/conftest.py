"""Fixtures of the adapter tests: each stack's tests run on every tier (memory, LMDB, Redis)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
from adapter_helpers import tier_settings

TIERS = ("memory", "lmdb", "redis")


class Tier(NamedTuple):
    """One tier's kvstore settings, and its Redis server (None for the other tiers)."""

    name: str
    settings: dict[str, Any]
    redis: Any = None


@pytest.fixture(params=TIERS)
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    """Each test once per tier; the Redis one on a private redis-server."""
    server = request.getfixturevalue("redis_server") if request.param == "redis" else None
    return Tier(request.param, tier_settings(request.param, tmp_path, server), server)
