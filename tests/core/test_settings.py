import argparse

import pytest

from kvstore.config import CacheConfig, ConfigError
from kvstore.settings import add_cache_args, config_from_args, load_config


def test_sources_merge_with_flags_over_env_over_toml(tmp_path):
    toml = tmp_path / "kv.toml"
    toml.write_text('[cache]\nblock_size = 32\nredis_url = "redis://a:1"\nlmdb_map_size_gb = 2\n')
    env = {"KVSTORE_REDIS_URL": "redis://b:2", "KVSTORE_DEVICE_BLOCKS": "128"}
    config = load_config(toml, env=env, overrides={"device_blocks": "64"})
    assert (config.block_size, config.redis_url, config.device_blocks) == (32, "redis://b:2", 64)
    assert config.lmdb_map_size_gb == 2.0


def test_cli_flags_map_to_config_fields(monkeypatch):
    monkeypatch.delenv("KVSTORE_CONFIG", raising=False)
    parser = argparse.ArgumentParser()
    add_cache_args(parser)
    args = parser.parse_args(
        ["--block-size", "8", "--lmdb-dir", "/tmp/x", "--device-cache-gb", "0.5"]
    )
    config = config_from_args(args)
    assert (config.block_size, config.lmdb_dir, config.device_cache_gb) == (8, "/tmp/x", 0.5)
    assert config.redis_url is None


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"block_size": "sixteen"}, "block_size"),
        ({"block_size": 0}, "block_size"),
        ({"redis_url": "http://x"}, "redis_url"),
        ({"eviction_policy": "random"}, "eviction_policy"),
        ({"tenant_salt": "x" * 300}, "tenant_salt"),
        ({"device_blocks": -1}, "device_blocks"),
    ],
)
def test_a_bad_value_raises_a_config_error_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides=overrides)
    assert info.value.field == field


def test_unknown_toml_keys_are_rejected(tmp_path):
    toml = tmp_path / "kv.toml"
    toml.write_text("blok_size = 16\n")
    with pytest.raises(ConfigError, match="blok_size"):
        load_config(toml, env={})


def test_config_is_frozen():
    config = CacheConfig()
    with pytest.raises(AttributeError):
        config.block_size = 8  # type: ignore[misc]
