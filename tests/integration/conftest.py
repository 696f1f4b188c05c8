"""Fixtures for integration tests: a micro model saved like a real checkpoint."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from engine_helpers import micro_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The micro model and its tokenizer, written with save_pretrained (loaded by path)."""
    path = tmp_path_factory.mktemp("micro-model")
    loaded = micro_model(seed=1)
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return path
