"""`kvstore router` in front of replicas with small device pools over host-memory tiers:
each replica names its tiers in /health and publishes their events, the router indexes
them per medium, and a conversation whose blocks left the device for its replica's host
tier goes back there (a cold replica would recompute it)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from router_helpers import (
    AUTH,
    REPLICA,
    chat,
    health,
    replica_rows,
    running_fleet,
    start_router,
)
from server_helpers import ServerProcess, wait_for

from engine.router.fleet import PENDING_S

TIERED = ("--device-blocks", "128", "--memory-cache-gb", "0.05")


@pytest.fixture(scope="module")
def tiered(model_dir: Path, tmp_path_factory) -> Iterator[tuple[ServerProcess, list, Path]]:
    log_dir = tmp_path_factory.mktemp("tiers")
    with running_fleet(model_dir, log_dir, replica_args=TIERED) as (router, replicas):
        yield router, replicas, model_dir


def host_entries(replica: ServerProcess) -> float:
    return replica.metrics()['kvstore_store_entries{tier="memory"}']


def memory_hits(replica: ServerProcess) -> float:
    return replica.metrics().get('kvstore_prefix_cache_hits_tokens_total{tier="memory"}', 0.0)


def test_a_replica_names_its_private_host_tier_in_health(tiered):
    _, replicas, _ = tiered
    for replica in replicas:
        assert health(replica)["cache"]["tiers"] == [
            {"name": "memory", "medium": "HOST", "shared": None}
        ]


def evicted_chat(
    router: ServerProcess, replicas: list[ServerProcess], seed: str
) -> tuple[ServerProcess, Callable[[], httpx.Response]]:
    """A chat's first turn through `router`; then prompts sent straight to the replica that
    served it, which push the chat out of its 128-block device into its host tier. Returns
    (that replica, what sends the chat's second turn through `router`)."""
    messages = [{"role": "system", "content": f"{seed} " * 20}, {"role": "user", "content": "hi"}]
    first = chat(router, messages)
    routed_at = time.monotonic()
    assert first.status_code == 200, first.text
    home = next(r for r in replicas if r.url == first.headers[REPLICA])
    for i in range(6):
        body = {"prompt": f"{seed} filler {i} " * 25, "max_tokens": 1}
        reply = httpx.post(f"{home.url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert reply.status_code == 200, reply.text
    # every router's view of its host tier is the tier's own count (one block an entry)
    wait_for(lambda: replica_rows(router)[home.url]["indexed_tier_blocks"].get("HOST")
             == host_entries(home))  # fmt: skip
    # the router counts a prompt it just routed as held there for PENDING_S (its events may
    # lag): past that, only what the events say of the replica's tiers counts
    time.sleep(max(0.0, PENDING_S - (time.monotonic() - routed_at)))
    answer = first.json()["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    return home, lambda: chat(router, messages)


@pytest.mark.integration
def test_a_conversation_in_its_replicas_host_tier_goes_back_there(tiered):
    router, replicas, _ = tiered
    home, send_second = evicted_chat(router, replicas, "gamma")
    before = memory_hits(home)
    second = send_second()
    assert second.status_code == 200, second.text
    # the other replica has routed fewer requests: only the host tier's blocks bring it home
    assert second.headers[REPLICA] == home.url
    assert memory_hits(home) > before


@pytest.mark.integration
def test_control_a_router_fed_device_events_only_sends_it_to_a_cold_replica(tiered, tmp_path):
    _, replicas, model_dir = tiered
    urls = [r.url for r in replicas]
    with start_router(model_dir, tmp_path, urls, "--device-events-only") as router:
        wait_for(lambda: all(r["events"] == "fresh" for r in health(router)["replicas"]))
        home, send_second = evicted_chat(router, replicas, "delta")
        second = send_second()
        assert second.status_code == 200, second.text
        assert second.headers[REPLICA] != home.url


def test_a_replicas_read_costs_are_kept_only_when_well_formed():
    from engine.router.fleet import measured_costs

    assert measured_costs({"REDIS": 0.25, "DISK": 1, "HOST": 0.0}) == {
        "REDIS": 0.25, "DISK": 1.0, "HOST": 0.0
    }  # fmt: skip
    bad = {"REDIS": 1.5, "DISK": -0.1, "HOST": "0.1", "GPU": 0.1, "CPU": True}
    assert measured_costs(bad) == {}
    assert measured_costs(None) == measured_costs([0.1]) == {}
