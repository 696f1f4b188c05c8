"""Fixtures for server tests: the micro model saved to disk and a shared, keyed server."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from engine_helpers import micro_config
from server_helpers import (
    SERVED_NAME,
    TENANT_KEYS,
    ServerProcess,
    clean_env,
    free_port,
    kvstore_script,
)

from engine.model.loading import byte_tokenizer, random_model

LONG_POSITIONS = 8192  # room for a request slow enough to hold the queue


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The micro Llama (2 layers, hidden 64, byte tokenizer with a chat template) on disk."""
    path = tmp_path_factory.mktemp("micro-model")
    config = micro_config()
    config.max_position_embeddings = LONG_POSITIONS
    random_model(config, seed=1).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def keyed_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """One server for the client, auth and limit tests: tenants x (two keys) and y, one
    request running at a time and a queue bound of 1, small body and prompt limits, /metrics
    behind a key."""
    base = tmp_path_factory.mktemp("keyed-server")
    keys = base / "api_keys.json"
    keys.write_text(json.dumps(TENANT_KEYS))
    port = free_port()
    args = [kvstore_script(), "serve", "--model", str(model_dir), "--served-model-name",
            SERVED_NAME, "--port", str(port), "--block-size", "4", "--device-blocks", "1024",
            "--device", "cpu", "--api-keys-file", str(keys), "--metrics-require-key",
            "--max-queue", "1", "--max-num-seqs", "1", "--max-body-bytes", "65536",
            "--max-prompt-tokens", "2000",
            "--max-tokens-limit", "6000", "--log-level", "warning"]  # fmt: skip
    server = ServerProcess(args, port, base / "server.log", clean_env()).start()
    try:
        yield server.wait_ready()
    finally:
        server.stop()
