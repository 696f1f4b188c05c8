"""`kvstore serve --role` and `kvstore router --handover-min-tokens`: valid values, and a
prefill or decode replica without a tier to hand KV over through is refused at start."""

from __future__ import annotations

import subprocess

import pytest
from server_helpers import clean_env, kvstore_script

from engine.router.config import RouterConfig
from engine.server.config import ServerConfig, check_role
from kvstore.config import ConfigError


def test_a_role_is_one_of_both_prefill_and_decode():
    assert ServerConfig().role == "both"
    for role in ("prefill", "decode"):
        assert ServerConfig(role=role).role == role
    with pytest.raises(ConfigError, match="role: choose from both, prefill, decode, got 'p'"):
        ServerConfig(role="p")


def test_prefill_and_decode_replicas_need_a_shared_tier():
    check_role(ServerConfig(), shared_tier=False)  # `both` works alone
    for role in ("prefill", "decode"):
        check_role(ServerConfig(role=role), shared_tier=True)
        with pytest.raises(ConfigError, match="give --redis-url"):
            check_role(ServerConfig(role=role), shared_tier=False)


@pytest.mark.parametrize("value", [-1, 1.5, True, "256"])
def test_a_bad_handover_threshold_is_refused(value):
    with pytest.raises(ConfigError, match="handover_min_tokens: must be an int >= 0"):
        RouterConfig(replicas=("http://a:1",), handover_min_tokens=value)
    with pytest.raises(ConfigError, match="handover_max_queued_tokens: must be an int >= 1"):
        RouterConfig(replicas=("http://a:1",), handover_max_queued_tokens=value or 0)


def test_serve_refuses_a_decode_role_without_a_shared_tier_before_loading_a_model():
    out = subprocess.run([kvstore_script(), "serve", "--model", "tiny", "--role", "decode"],
                         capture_output=True, text=True, timeout=120, env=clean_env())  # fmt: skip
    assert out.returncode == 2
    assert "role: --role decode hands KV over through a shared tier: give --redis-url" in (
        out.stderr
    )
