import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

from kvstore.config import CacheConfig, ConfigError
from kvstore.config.help import flag_name, with_table
from kvstore.config.settings import add_cache_args, config_from_args, load_config


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


ROOT = Path(__file__).resolve().parents[2]
# A valid value for each flag whose field defaults to None or to an empty string.
SAMPLES = {
    "device_cache_gb": 0.5,
    "device_blocks": 8,
    "tenant_salt": "tenant-a",
    "tenant_quota_blocks": 4,
    "retention_quota_blocks": 8,
    "tail_blocks": 16,
    "lmdb_dir": "kv",
    "redis_url": "redis://localhost:6379/0",
    "redis_ttl_s": 60,
}


def documented_flags(text: str) -> set[str]:
    """The flags a markdown text names in code spans: `--flag` or `--flag VALUE`."""
    return set(re.findall(r"`(--[a-z][a-z0-9-]*)[` ]", text))


def test_the_config_table_in_the_docs_is_the_one_the_fields_generate():
    doc = (ROOT / "docs" / "CONFIG.md").read_text()
    assert with_table(doc) == doc, "run: python -m kvstore.config.help --write docs/CONFIG.md"
    assert "--secret" not in doc


def test_every_flag_in_config_md_parses_into_its_field_and_every_flag_is_documented():
    parser = argparse.ArgumentParser()
    add_cache_args(parser)
    flags = {o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}
    cache_part = (ROOT / "docs" / "CONFIG.md").read_text().split("## Engine settings")[0]
    assert documented_flags(cache_part) == flags
    for f in fields(CacheConfig):
        if flag_name(f.name) is None:
            continue
        value = SAMPLES.get(f.name, f.default)
        args = parser.parse_args([flag_name(f.name), str(value)])
        assert getattr(load_config(env={}, overrides=_overrides(args)), f.name) == value


def test_config_md_names_the_fields_whose_flags_stats_and_clear_take():
    from engine.admin import TIER_SETTINGS

    doc = " ".join((ROOT / "docs" / "CONFIG.md").read_text().split())
    listed = doc.split("`stats` and `clear` have no device pool")[1].split("(")[1].split(")")[0]
    assert set(listed.split(", ")) == set(TIER_SETTINGS) - {"secret"}


def _overrides(args: argparse.Namespace) -> dict:
    return {k.removeprefix("cache_"): v for k, v in vars(args).items() if v is not None}


def test_every_flag_deploy_md_documents_is_a_flag_of_kvstore_serve():
    from engine.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {o for a in serve._actions for o in a.option_strings}
    deploy = (ROOT / "docs" / "DEPLOY.md").read_text()
    section = deploy.split("## `kvstore serve`")[1].split("\n## ")[0]
    assert len(documented_flags(section)) == 27  # model flags and the server's own
    assert documented_flags(section) - flags == set()


def test_every_flag_deploy_md_documents_is_a_flag_of_kvstore_router():
    from engine.cli import build_parser

    router = build_parser()._subparsers._group_actions[0].choices["router"]
    flags = {o for a in router._actions for o in a.option_strings} - {"-h", "--help"}
    deploy = (ROOT / "docs" / "DEPLOY.md").read_text()
    section = deploy.split("## A fleet behind `kvstore router`")[1].split("\n## ")[0]
    cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `--")]
    assert documented_flags(" ".join(cells)) == flags  # its table: every flag, nothing else
