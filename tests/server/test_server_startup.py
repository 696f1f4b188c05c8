"""What `kvstore serve` says when it starts: model, device, dtype, pool size and tiers, and
where it publishes its KV events and answers their replays."""

from __future__ import annotations

import pytest
from server_helpers import ServerProcess, clean_env, free_port, kvstore_script

pytestmark = pytest.mark.integration


def test_start_up_logs_model_device_dtype_pool_tiers_and_event_ports(
    model_dir, redis_server_factory, tmp_path
):
    redis = redis_server_factory("--requirepass", "pw-secret", password="pw-secret")
    port, lmdb, events, replay = free_port(), tmp_path / "lmdb", free_port(), free_port()
    args = [kvstore_script(), "serve", "--model", str(model_dir), "--port", str(port),
            "--device", "cpu", "--block-size", "4", "--device-blocks", "64",
            "--lmdb-dir", str(lmdb), "--redis-url", redis.url, "--kv-events-port", str(events),
            "--kv-events-replay-port", str(replay)]  # fmt: skip
    server = ServerProcess(args, port, tmp_path / "server.log", clean_env()).start()
    try:
        server.wait_ready()
    finally:
        server.stop()
    log = server.log_path.read_text()
    # 2 layers x K and V x 2 heads x 4 tokens x 16 dims x 4 bytes = 2048 bytes a block
    lines = [line for line in log.splitlines() if line.startswith("kvstore serve: ")]
    assert [line for line in lines if "draining" not in line and "drained" not in line] == [
        f"kvstore serve: info: KV events on tcp://127.0.0.1:{events} (--kv-events-port), "
        f"replays on tcp://127.0.0.1:{replay} (--kv-events-replay-port)",
        f"kvstore serve: info: model {model_dir} (2 layers, float32) on cpu; pool 64 blocks of "
        f"4 tokens (1 reserved for the runner's scratch) = 131,072 bytes (0.1 MiB); tiers: "
        f"device, lmdb ({lmdb}), redis "
        f"(redis://:***@127.0.0.1:{redis.port}/0); continuous batching",
        "kvstore serve: info: shutdown: cache integrity ok; 0 of 64 device blocks held after "
        "the last request",
    ]
    assert "pw-secret" not in log
