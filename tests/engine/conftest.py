"""Fixtures for engine tests (helpers live in engine_helpers, importable by name)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from engine_helpers import micro_cache_config, micro_model

from engine.loop.engine import Engine
from engine.model.loading import LoadedModel


@pytest.fixture(scope="session")
def micro() -> LoadedModel:
    return micro_model(seed=1)


@pytest.fixture
def engine(micro: LoadedModel) -> Iterator[Engine]:
    with Engine(micro, micro_cache_config()) as eng:
        yield eng
