"""`prompt_cache_key` affinity in `kvstore router`: requests with one key go to one replica
while its load is within `--cache-key-load-slack` of the least loaded replica's; past that,
or when that replica is down or failed the request, the request is routed by cost and the
key moves with it. Requests without a key are routed as before."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from router_helpers import REPLICA, busy, chat, running_fleet
from server_helpers import ServerProcess, parse_metrics

from engine.router.affinity import CacheKeys
from engine.router.app import Router, _cache_key
from engine.router.config import RouterConfig, add_router_arguments, router_config_from_args
from kvstore.config import ConfigError
from kvstore.fleet.routing import RoutingConfig

SLACK = 100.0  # prefill-token units: 100 queued tokens, or 1000 running ones
PROMPT = list(range(10))


def keyed_router(slack: float = SLACK) -> Router:
    """A router over two live replicas that publish no events (routed by load alone)."""
    config = RouterConfig(replicas=("http://a:1", "http://b:1"),
                          routing=RoutingConfig(key_load_slack=slack))  # fmt: skip
    router = Router(config, tokenizer=None)
    for replica in router.fleet.replicas:
        replica.alive = True
    return router


def pick(router: Router, key: str | None, tried: list | None = None) -> str:
    """Where a 10-token prompt goes (its tokens stay queued there: never prefilled)."""
    cache_key = ("", key) if key is not None else None
    replica, cached = router._pick(PROMPT, [], None, tried or [], cache_key)
    router.fleet.sent(replica, len(PROMPT) - cached)  # as the router's request path does
    return replica.url[len("http://") : -len(":1")]


def test_equal_keys_stay_on_one_replica_until_its_load_passes_the_bound():
    router = keyed_router()
    # each request queues 10 tokens on a: it is within 100 of b's 0 until it holds 110
    assert [pick(router, "agent") for _ in range(12)] == ["a"] * 11 + ["b"]
    assert [pick(router, "agent") for _ in range(3)] == ["b"] * 3  # the key moved with it
    assert router.fleet.counts["cache_key"] == 10 + 3
    assert router.cache_keys.moves == {"load": 1, "unavailable": 0}


def test_a_key_of_a_replica_that_is_down_or_failed_moves_and_stays_moved():
    router = keyed_router()
    a, b = router.fleet.replicas
    assert pick(router, "agent") == "a"
    router.fleet.dead(a, "test")
    assert [pick(router, "agent") for _ in range(2)] == ["b", "b"]
    a.alive = True  # back, and idle: the key stays where it went
    assert pick(router, "agent") == "b"
    assert pick(router, "agent", tried=[b]) == "a"  # b failed this request: a takes the key
    assert pick(router, "agent") == "a"
    assert router.cache_keys.moves == {"load": 0, "unavailable": 2}


def test_requests_without_a_key_are_routed_as_before():
    keyed, plain = keyed_router(), keyed_router()
    routes = [pick(keyed, None) for _ in range(4)]
    for _ in range(4):  # the fleet's own choice, each prompt queued where it went
        plain.fleet.sent(plain.fleet.choose(len(PROMPT), [])[0], len(PROMPT))
    assert [r.routed for r in keyed.fleet.replicas] == [r.routed for r in plain.fleet.replicas]
    assert routes == ["a", "b", "a", "b"]  # least loaded, ties to fewer routed
    assert keyed.fleet.counts["cache_key"] == 0 and len(keyed.cache_keys._pins) == 0


def test_a_key_is_one_key_per_cache_salt():
    """Two tenants' equal keys share no cache: each goes where its own requests went."""
    request = SimpleNamespace(prompt_cache_key="agent")
    assert _cache_key(request, "tenant-x") != _cache_key(request, "tenant-y")
    assert _cache_key(SimpleNamespace(), "") is None
    assert _cache_key(SimpleNamespace(prompt_cache_key=""), "") is None


def test_the_least_recently_used_key_is_forgotten_first():
    router = keyed_router()
    keys = CacheKeys(router.fleet, max_keys=2)
    a, b = router.fleet.replicas
    keys.pin(("", "one"), a)
    keys.pin(("", "two"), b)
    assert keys.pinned(("", "one"), []) is a  # "two" is now the least recently used
    keys.pin(("", "three"), b)
    assert [keys.pinned(("", k), []) for k in ("one", "two", "three")] == [a, None, b]


@pytest.mark.parametrize("slack", ["-1", "nan", "inf"])
def test_a_bad_load_slack_is_refused_by_name(slack):
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    args = parser.parse_args(["--replica", "http://a:1", "--cache-key-load-slack", slack])
    with pytest.raises(ConfigError, match="key_load_slack must be a finite number >= 0"):
        router_config_from_args(args, env={})


# --- through real replicas ------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory) -> Iterator[tuple[ServerProcess, list]]:
    """Two replicas with events behind a kv router whose key load slack is SLACK."""
    args = ("--cache-key-load-slack", str(SLACK))
    with running_fleet(model_dir, tmp_path_factory.mktemp("keys"), router_args=args) as fleet:
        yield fleet


def keyed_chat(router: ServerProcess, text: str, key: str) -> str:
    """The replica that answered an unrelated prompt sent with `key`."""
    response = chat(router, [{"role": "user", "content": text}], prompt_cache_key=key)
    assert response.status_code == 200, response.text
    return response.headers[REPLICA]


def router_metric(router: ServerProcess, name: str) -> float:
    return parse_metrics(httpx.get(f"{router.url}/metrics", timeout=10).text)[name]


@pytest.mark.integration
def test_equal_keys_land_on_one_replica_then_spill_over_past_the_load_bound(fleet):
    router, replicas = fleet
    homes = {keyed_chat(router, f"unrelated prompt {i} " * 6, "agent-1") for i in range(4)}
    assert len(homes) == 1
    (home,) = homes
    other = next(r for r in replicas if r.url != home)
    decided = 'kvstore_router_decisions_total{how="cache_key"}'
    before = router_metric(router, decided)
    with busy(next(r for r in replicas if r.url == home), router):  # > 1000 running tokens
        assert keyed_chat(router, "while it is busy " * 6, "agent-1") == other.url
    # the key moved with that request: it stays there, though its old replica is idle again
    assert [keyed_chat(router, f"after {i} " * 6, "agent-1") for i in range(2)] == [other.url] * 2
    assert router_metric(router, decided) == before + 2
    assert router_metric(router, 'kvstore_router_cache_key_moves_total{why="load"}') == 1


@pytest.mark.integration
def test_the_key_of_a_killed_replica_moves_to_a_live_one(fleet):
    """Last in this module: it kills a replica of the shared fleet."""
    router, replicas = fleet
    moves = 'kvstore_router_cache_key_moves_total{why="%s"}'

    def moved_keys() -> float:
        return sum(router_metric(router, moves % why) for why in ("unavailable", "load"))

    home = keyed_chat(router, "a key about to lose its replica " * 3, "agent-2")
    before = moved_keys()
    victim = next(r for r in replicas if r.url == home)
    survivor = next(r for r in replicas if r is not victim)
    victim.proc.kill()
    victim.proc.wait()
    moved = [keyed_chat(router, f"after the kill {i} " * 4, "agent-2") for i in range(3)]
    assert moved == [survivor.url] * 3
    # one move, whether the router had seen it down, or the first request found it so, or
    # (its health reads not yet failed twice) its last report made it the busier one
    assert moved_keys() == before + 1
