"""docker-compose.yml, checked without Docker: every command parses, no secret is on a
command line, the image is built once, and two replicas started with exactly its commands,
flags, environment and Redis config file (hosts, ports and the model path moved to loopback
and a tmp dir) share the Redis tier it configures."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml
from server_helpers import (
    ROOT,
    Compose,
    ServerProcess,
    clean_env,
    flag_value,
    free_port,
    kvstore_script,
    replace_flag,
    wait_for,
)

from bench.__main__ import BENCHMARKS
from engine.cli import build_parser, config_from_args
from engine.router.config import router_config_from_args
from engine.server.config import server_config_from_args
from kvstore.adapters.blocks import config_from_settings

ENGINES = ("engine-a", "engine-b")
SPLIT = ("prefill", "decode")  # the `split` profile's replicas, by their --role
ROUTERS = {"router": ENGINES, "router-split": SPLIT}


@pytest.fixture(scope="module")
def compose() -> Compose:
    return Compose()


def parse_kvstore(command: list[str]):
    assert command[0] == "kvstore"
    return build_parser().parse_args(command[1:])


def kvstore_config(command: list[str], env: dict[str, str], monkeypatch):
    """The CacheConfig a compose `kvstore` command builds with its service's environment."""
    with monkeypatch.context() as m:
        for key, value in env.items():
            m.setenv(key, value)
        return config_from_args(parse_kvstore(command))


def test_every_compose_command_and_flag_parses(compose, monkeypatch):
    seen = set()
    for name, service in compose.services.items():
        command = compose.command(name)
        if command[:2] == ["kvstore", "router"]:
            config = router_config_from_args(parse_kvstore(command), compose.environment(name))
            assert config.replicas == tuple(f"http://{e}:8000" for e in ROUTERS[name])
        elif command[0] == "kvstore":
            kvstore_config(command, compose.environment(name), monkeypatch)  # values valid too
            server = server_config_from_args(parse_kvstore(command), compose.environment(name))
            assert server.role == (name if name in SPLIT else "both")
        elif command[:3] == ["python", "-m", "bench"]:
            assert command[3] in BENCHMARKS
            importlib.import_module(f"bench.{command[3]}").build_parser().parse_args(command[4:])
        elif name in STACKS:
            check_stack_service(compose, name)
            seen.add(STACKS[name][0])
            continue
        else:
            assert command[0] == "redis-server"  # its flags: the replica test starts it
            assert "healthcheck" in service
        seen.add(" ".join(command[:2] if command[0] != "python" else command[:4]))
    conf = "/usr/local/etc/redis/auth.conf"
    assert seen == {"kvstore serve", "kvstore router", "python -m bench serve",
                    f"redis-server {conf}", "vllm", "lmcache", "sglang"}  # fmt: skip
    assert compose.services["redis"]["configs"] == [{"source": "redis-auth", "target": conf}]
    assert compose.services["bench"]["profiles"] == ["bench"]
    for name in (*SPLIT, "router-split"):
        assert compose.services[name]["profiles"] == ["split"]
    for name in SPLIT:  # the engines' command, and a role
        assert compose.command(name)[:-2] == compose.command("engine-a")


# The `stacks` profile: service -> (stack, its command's first words). Each stack's own
# tests (tests/adapters) load these plug-in configs through the stack's real loader.
STACKS = {
    "vllm-a": ("vllm", ["vllm", "serve"]),
    "vllm-b": ("vllm", ["vllm", "serve"]),
    "vllm-lmcache": ("lmcache", ["vllm", "serve"]),
    "sglang": ("sglang", ["python", "-m", "sglang.launch_server"]),
}


def adapter_classes(stack: str) -> set[str]:
    """Class names defined in kvstore/adapters/<stack>.py (read, not imported: the stack
    itself is installed only in its own venv)."""
    tree = ast.parse((ROOT / "kvstore" / "adapters" / f"{stack}.py").read_text())
    return {node.name for node in tree.body if isinstance(node, ast.ClassDef)}


def stack_plugin(compose, name: str) -> tuple[str, str, dict]:
    """(module path, class name, kvstore settings) a stack service's config names."""
    command = compose.command(name)
    if name.startswith("vllm-") and name != "vllm-lmcache":
        kv = json.loads(flag_value(command, "--kv-transfer-config"))
        (tier,) = kv["kv_connector_extra_config"]["secondary_tiers"]
        assert kv["kv_connector_extra_config"]["spec_name"] == "TieringOffloadingSpec"
        return tier["module_path"], tier["type"], tier["kvstore"]
    if name == "vllm-lmcache":
        kv = json.loads(flag_value(command, "--kv-transfer-config"))
        assert kv["kv_connector"] == "LMCacheConnectorV1"
        (config,) = compose.services[name]["configs"]
        source = compose.data["configs"][config["source"]]["file"]
        assert compose.environment(name)["LMCACHE_CONFIG_FILE"] == config["target"]
        lmcache = yaml.safe_load((ROOT / source).read_text())
        assert "remote_url" not in lmcache  # one backend: the plugin alone
        assert lmcache["remote_storage_plugins"] == ["kvstore"]
        extra = lmcache["extra_config"]
        plugin = "remote_storage_plugin.kvstore."
        return extra[plugin + "module_path"], extra[plugin + "class_name"], extra["kvstore"]
    assert flag_value(command, "--hicache-storage-backend") == "dynamic"
    extra = json.loads(flag_value(command, "--hicache-storage-backend-extra-config"))
    assert extra["interface_v1"] == 1
    return extra["module_path"], extra["class_name"], extra["kvstore"]


def check_stack_service(compose, name: str) -> None:
    """A stack's service: its profile, its command, the Redis URL (with the password) and
    the secret of the engines, and a plug-in config naming an adapter with valid settings."""
    stack, words = STACKS[name]
    service, command = compose.services[name], compose.command(name)
    assert service["profiles"] == ["stacks"] and command[: len(words)] == words
    assert service["build"]["args"]["KVSTORE_EXTRA"] == stack
    env = compose.environment(name)
    password = compose.redis_password()
    assert env["KVSTORE_REDIS_URL"] == f"redis://:{password}@redis:6379/0"
    assert env["KVSTORE_SECRET"] == compose.environment("engine-a")["KVSTORE_SECRET"]
    module, class_name, settings = stack_plugin(compose, name)
    assert module == f"kvstore.adapters.{stack}" and class_name in adapter_classes(stack)
    config = config_from_settings(settings, env=env)
    assert config.redis_url == env["KVSTORE_REDIS_URL"] and config.secret == env["KVSTORE_SECRET"]


def test_engines_reach_redis_with_its_password_and_share_a_secret(compose, monkeypatch):
    password = compose.redis_password()
    assert password == "kvstore-dev-password"  # the documented default
    assert flag_value(compose.command("redis"), "--maxmemory-policy") == "allkeys-lru"
    for name in ENGINES:
        config = kvstore_config(compose.command(name), compose.environment(name), monkeypatch)
        assert config.redis_url == f"redis://:{password}@redis:6379/0"
    envs = [compose.environment(name) for name in ENGINES]
    assert envs[0]["KVSTORE_SECRET"] == envs[1]["KVSTORE_SECRET"] != ""


def test_no_secret_is_on_a_command_line(monkeypatch):
    secrets = {"REDIS_PASSWORD": "redis-pw-1", "KVSTORE_SECRET": "secret-2",
               "KVSTORE_API_KEY": "sk-key-3"}  # fmt: skip
    compose = Compose(env=secrets)
    for name, service in compose.services.items():
        seen = " ".join([*compose.command(name), *map(str, service["healthcheck"]["test"])]
                        if "healthcheck" in service else compose.command(name))  # fmt: skip
        assert not [s for s in secrets.values() if s in seen], name
    assert compose.redis_password() == "redis-pw-1"
    assert compose.environment("redis")["REDISCLI_AUTH"] == "redis-pw-1"
    for name in ENGINES:
        config = kvstore_config(compose.command(name), compose.environment(name), monkeypatch)
        assert (config.redis_url, config.secret) == ("redis://:redis-pw-1@redis:6379/0", "secret-2")
        assert compose.environment(name)["KVSTORE_API_KEY"] == "sk-key-3"
    assert compose.environment("bench")["KVSTORE_API_KEY"] == "sk-key-3"
    router = router_config_from_args(parse_kvstore(compose.command("router")),
                                     compose.environment("router"))  # fmt: skip
    assert dict(router.api_keys) == {"sk-key-3": "default"} and router.secret == "secret-2"


def test_the_image_is_built_once_and_reused(compose):
    services = compose.services
    built = [name for name, s in services.items() if "build" in s and name not in STACKS]
    assert built == ["engine-a"]  # the stacks build their own images (Dockerfile.stack)
    reusing = ("engine-b", "router", "bench", *SPLIT, "router-split")
    assert {services[name]["image"] for name in (*ENGINES, *reusing)} == {"kvstore:latest"}
    assert [services[name].get("pull_policy") for name in reusing] == ["never"] * len(reusing)


def test_only_the_router_is_published(compose):
    published = {name: s["ports"] for name, s in compose.services.items()
                 if "ports" in s and name not in STACKS}  # fmt: skip
    assert published == {"router": ["127.0.0.1:8000:8000"],
                         "router-split": ["127.0.0.1:8001:8000"]}  # fmt: skip


def loopback_engine(compose, name, model_dir, redis_port, log_dir) -> ServerProcess:
    """The compose command of `name` on loopback: only host, port, model and Redis host move."""
    command = compose.command(name)
    port = free_port()
    for flag, value in [("--host", "127.0.0.1"), ("--port", str(port)),
                        ("--model", str(model_dir)), ("--kv-events-port", str(free_port())),
                        ("--kv-events-replay-port", str(free_port()))]:  # fmt: skip
        command = replace_flag(command, flag, value)
    env = compose.environment(name)
    env["KVSTORE_REDIS_URL"] = env["KVSTORE_REDIS_URL"].replace(
        "@redis:6379", f"@127.0.0.1:{redis_port}"
    )
    args = [kvstore_script(), *command[1:]]
    return ServerProcess(args, port, log_dir / f"{name}.log", clean_env(**env))


def compose_fleet(compose, model_dir, redis_server_factory, tmp_path, names):
    """Redis with the compose flags and config file, then the engines `names`; yields
    (redis, a, b)."""
    conf = tmp_path / "auth.conf"
    conf.write_text(compose.config_content("redis-auth"))
    redis_args = compose.command("redis")[2:]  # after redis-server and the config file
    password = compose.redis_password()
    redis = redis_server_factory(*redis_args, config_file=conf, password=password)
    a, b = (loopback_engine(compose, n, model_dir, redis.port, tmp_path) for n in names)
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start().wait_ready(), (a, b)))
        yield redis, a, b
    finally:
        a.stop()
        b.stop()


@pytest.fixture
def replicas(compose, model_dir, redis_server_factory, tmp_path):
    yield from compose_fleet(compose, model_dir, redis_server_factory, tmp_path, ENGINES)


@pytest.fixture
def split_replicas(compose, model_dir, redis_server_factory, tmp_path):
    yield from compose_fleet(compose, model_dir, redis_server_factory, tmp_path, SPLIT)


def completion(server, key: str, prompt: list[int], **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True} | extra  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.integration
def test_replica_b_hits_what_replica_a_wrote_through_to_redis(compose, replicas, model_dir,
                                                              tmp_path):  # fmt: skip
    _, a, b = replicas
    key = compose.environment("engine-a")["KVSTORE_API_KEY"]
    block = int(flag_value(compose.command("engine-a"), "--block-size"))
    prompt = [(i * 13 + 5) % 256 for i in range(6 * block + 5)]  # 6 whole blocks before L-1
    first = completion(a, key, prompt)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # A stores prompt + output but the last token: 6 * block + 12 tokens = 6 whole blocks.
    redis_writes = 'kvstore_tier_writes_blocks_total{tier="redis"}'
    wait_for(lambda: a.metrics().get(redis_writes) == 6)
    second = completion(b, key, prompt)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * block
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    metrics = b.metrics()
    assert metrics['kvstore_prefix_cache_hits_tokens_total{tier="redis"}'] == 6 * block
    assert metrics['kvstore_store_hits_total{tier="redis"}'] == 6
    assert metrics["kvstore_promoted_blocks_total"] == 6
    assert metrics['kvstore_tier_breaker_state{state="closed",tier="redis"}'] == 1
    router = loopback_router(compose, model_dir, a, b, tmp_path)
    try:
        run_compose_bench(compose, router, key)
        rows = httpx.get(f"{router.url}/health", timeout=10).json()["replicas"]
        assert sum(r["routed"] for r in rows) == 8
        assert [r["events"] for r in rows] == ["fresh", "fresh"]  # both publish their events
    finally:
        router.stop()


def loopback_router(compose, model_dir, a, b, log_dir, name: str = "router") -> ServerProcess:
    """The compose router command of `name` on loopback, in front of two loopback engines."""
    command, port = compose.command(name), free_port()
    for flag, value in [("--host", "127.0.0.1"), ("--port", str(port)),
                        ("--model", str(model_dir))]:  # fmt: skip
        command = replace_flag(command, flag, value)
    urls = iter([a.url, b.url])
    command = [next(urls) if c.startswith("http://") else c for c in command]
    env = clean_env(**compose.environment(name))
    proc = ServerProcess([kvstore_script(), *command[1:]], port, log_dir / "router.log", env,
                         "kvstore router")  # fmt: skip
    return proc.start().wait_ready()


def run_compose_bench(compose, router, key) -> None:
    """The compose bench command through the router, shortened to 8 requests."""
    command = compose.command("bench")
    command = replace_flag(command, "--requests", "8")
    command = replace_flag(command, "--concurrency", "2")
    command = [router.url if c == "http://router:8000" else c for c in command]
    env = compose.environment("bench")
    assert env["KVSTORE_API_KEY"] == key
    out = subprocess.run([sys.executable, *command[1:], "--json"], capture_output=True,
                         text=True, timeout=120, env=clean_env(**env))  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    workload = importlib.import_module("bench.serve").build_workload("multiturn", [], 8)
    assert (report["requests"], report["errors"]) == (8, 0)
    assert report["prompt_tokens"] == sum(len(r.token_ids) for r in workload)
    assert report["per_url"][router.url]["requests"] == 8


@pytest.mark.integration
def test_the_split_profile_hands_a_long_prompt_over_from_prefill_to_decode(
    compose, split_replicas, model_dir, tmp_path
):
    _, prefill, decode = split_replicas
    key = compose.environment("prefill")["KVSTORE_API_KEY"]
    block = int(flag_value(compose.command("prefill"), "--block-size"))
    minimum = int(flag_value(compose.command("router-split"), "--handover-min-tokens"))
    router = loopback_router(compose, model_dir, prefill, decode, tmp_path, "router-split")
    try:
        prompt = [(i * 7 + 3) % 256 for i in range(minimum + 3 * block)]
        answer = completion(router, key, prompt)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        whole = len(prompt) // block * block
        hits = decode.metrics()['kvstore_prefix_cache_hits_tokens_total{tier="redis"}']
        assert hits == whole
        assert decode.metrics()['kvstore_handovers_received_total{outcome="whole"}'] == 1
        fresh = completion(decode, key, prompt, cache_salt="uncached")  # computed whole
        assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert fresh["choices"][0]["token_ids"] == answer["choices"][0]["token_ids"]
    finally:
        router.stop()
