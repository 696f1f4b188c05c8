"""`kvstore router` in front of real `kvstore serve` replicas that publish their KV events:
it routes by the blocks the events say each replica holds, passes streams through, checks
keys and bodies itself, and loses no request when a replica is SIGKILLed."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_helpers import (
    AUTH,
    BLOCK,
    REPLICA,
    busy,
    cached_blocks,
    chat,
    health,
    indexed,
    running_fleet,
    start_router,
)
from server_helpers import ServerProcess, clean_env, kvstore_script, parse_metrics, wait_for

ROUTER_MAX_RSS_KB = 150 * 1024  # a router forwards HTTP: no engine, no libtorch


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory) -> Iterator[tuple[ServerProcess, list]]:
    """Two replicas with events behind a kv router: (router, [replica 0, replica 1])."""
    with running_fleet(model_dir, tmp_path_factory.mktemp("router")) as running:
        yield running


def conversation(
    seed: str, turns: int, router: ServerProcess, first: httpx.Response | None = None
) -> list[httpx.Response]:
    """A chat's turns in order, each with the history and the model's answers; after
    `first` (the answer to a first user turn of `seed * 60`) when given."""
    messages, out = [{"role": "system", "content": f"{seed} " * 40}], []
    if first is not None:
        answer = first.json()["choices"][0]["message"]["content"]
        messages = [{"role": "user", "content": f"{seed} " * 60},
                    {"role": "assistant", "content": answer}]  # fmt: skip
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t} about {seed}"})
        response = chat(router, messages)
        assert response.status_code == 200, response.text
        out.append(response)
        answer = response.json()["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": answer})
    return out


def cached(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.integration
def test_each_conversation_stays_where_its_history_is_cached(fleet):
    router, replicas = fleet
    alpha = conversation("alpha", 3, router)
    (home,) = {r.headers[REPLICA] for r in alpha}  # every turn where its history is
    other = next(r for r in replicas if r.url != home)
    with busy(next(r for r in replicas if r.url == home), router):
        beta = [chat(router, [{"role": "user", "content": "beta " * 60}])]
    assert beta[0].headers[REPLICA] == other.url  # the busy replica's load outweighed overlap
    beta += conversation("beta", 2, router, first=beta[0])
    assert {r.headers[REPLICA] for r in beta} == {other.url}
    for turns in (alpha, beta):
        assert cached(turns[0]) == 0
        for prev, resp in itertools.pairwise(turns):
            # the previous prompt is a prefix of this one (the micro model's answers are
            # random bytes, which need not survive re-encoding: past them nothing matches)
            whole = prev.json()["usage"]["prompt_tokens"] // BLOCK * BLOCK
            assert cached(resp) >= whole
    # the router's index of each replica is the replica's own device index, block for block
    for replica in replicas:
        wait_for(lambda r=replica: indexed(router, r) == cached_blocks(r))
        assert indexed(router, replica) > 0


@pytest.mark.integration
def test_streams_pass_through_chunk_by_chunk(fleet):
    router, _ = fleet
    body = {"messages": [{"role": "user", "content": "stream me"}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, headers=AUTH,
                      timeout=60) as response:  # fmt: skip
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][len("data: ") :])["usage"]
    assert usage["completion_tokens"] == 5
    assert len(events) >= 5 + 2  # a chunk per token, the usage and [DONE]


@pytest.mark.integration
def test_n_passes_through_to_the_replica_and_so_does_its_refusal(fleet):
    router, _ = fleet
    messages = [{"role": "user", "content": "two answers through the router"}]
    both = chat(router, messages, n=2, temperature=1.0, seed=4)
    assert both.status_code == 200, both.text
    assert [c["index"] for c in both.json()["choices"]] == [0, 1]
    assert both.json()["usage"]["completion_tokens"] == 12  # 6 each
    too_many = chat(router, messages, n=17)  # past the replica's --max-n (16)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    assert too_many.headers[REPLICA]  # the replica refused it, not the router


@pytest.mark.integration
def test_keys_and_bodies_are_checked_at_the_router(fleet):
    router, replicas = fleet
    before = [r.metrics() for r in replicas]
    no_key = httpx.post(f"{router.url}/v1/chat/completions", json={"messages": []}, timeout=30)
    assert no_key.status_code == 401
    assert no_key.json()["error"]["code"] == "invalid_api_key"
    bad = httpx.post(f"{router.url}/v1/chat/completions", json={"messages": "hi"},
                     headers=AUTH, timeout=30)  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    salt = chat(router, [{"role": "user", "content": "x"}], cache_salt=7)
    assert salt.status_code == 400 and salt.json()["error"]["param"] == "cache_salt"
    for fields, param in (
        ({"best_of": "x"}, "best_of"),
        ({"echo": "yes"}, "echo"),
        ({"stop": 5}, "stop"),
        ({"stream_options": {}}, "stream_options"),
    ):
        wrong = chat(router, [{"role": "user", "content": "x"}], **fields)
        assert (wrong.status_code, wrong.json()["error"]["param"]) == (400, param)
    gpt = chat(router, [{"role": "user", "content": "x"}], model="gpt-4")
    assert (gpt.status_code, gpt.json()["error"]["code"]) == (404, "model_not_found")
    nope = httpx.post(
        f"{router.url}/v1/messages",
        headers=AUTH,
        timeout=30,
        json={"model": "nope", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
    )
    assert (nope.status_code, nope.json()["error"]["type"]) == (404, "not_found_error")
    assert [r.metrics() for r in replicas] == before  # none of them reached a replica
    missing = httpx.get(f"{router.url}/v2/nothing", timeout=30)
    assert missing.status_code == 404 and "error" in missing.json()


@pytest.mark.integration
def test_the_router_counts_a_messages_tokens_as_its_replicas_do(fleet):
    router, replicas = fleet
    served = httpx.get(f"{replicas[0].url}/health", timeout=30).json()["model"]
    body = {"model": served, "system": "be brief " * 10,
            "messages": [{"role": "user", "content": "count these words"}]}  # fmt: skip
    counts = [httpx.post(f"{url}/v1/messages/count_tokens", json=body, headers=AUTH,
                         timeout=30).json() for url in (router.url, replicas[0].url)]  # fmt: skip
    assert counts[0] == counts[1] and counts[0]["input_tokens"] > 20


@pytest.mark.integration
def test_the_session_header_pins_a_conversation(fleet):
    router, _ = fleet
    homes = set()
    headers = AUTH | {"X-Session-ID": "pinned"}
    for i in range(4):  # unrelated prompts: without the header they would spread by load
        body = {"messages": [{"role": "user", "content": f"unrelated prompt {i} " * 5}],
                "max_tokens": 2, "temperature": 0}  # fmt: skip
        response = httpx.post(f"{router.url}/v1/chat/completions", headers=headers, json=body,
                              timeout=60)  # fmt: skip
        assert response.status_code == 200
        homes.add(response.headers[REPLICA])
    assert len(homes) == 1


@pytest.mark.integration
def test_router_metrics_count_decisions_per_replica(fleet):
    router, replicas = fleet
    page = parse_metrics(httpx.get(f"{router.url}/metrics", timeout=10).text)
    routed = sum(page[f'kvstore_router_routed_total{{replica="{r.url}"}}'] for r in replicas)
    decisions = sum(v for k, v in page.items() if k.startswith("kvstore_router_decisions_total"))
    assert routed == decisions > 0
    assert page['kvstore_router_decisions_total{how="fallback"}'] == 0  # events were fresh
    for r in replicas:
        assert page[f'kvstore_router_replica_up{{replica="{r.url}"}}'] == 1.0


@pytest.mark.integration
def test_stale_events_make_the_router_route_by_load(fleet, model_dir, tmp_path):
    """A second router that trusts no event older than 1 ms: every decision is by load."""
    _, replicas = fleet
    urls = [r.url for r in replicas]
    router = start_router(model_dir, tmp_path, urls, "--stale-after-s", "0.001")
    try:
        router.start().wait_ready()
        served = [chat(router, [{"role": "user", "content": "same prompt " * 8}]) for _ in range(4)]
        assert [s.status_code for s in served] == [200] * 4
        page = parse_metrics(httpx.get(f"{router.url}/metrics", timeout=10).text)
        assert page['kvstore_router_decisions_total{how="fallback"}'] == 4
        assert page['kvstore_router_decisions_total{how="kv"}'] == 0
        assert {r["events"] for r in health(router)["replicas"]} == {"stale"}
    finally:
        router.stop()


@pytest.mark.integration
def test_a_killed_replica_loses_no_request(fleet):
    """Last in this module (it kills a replica of the shared fleet): replica 0 is SIGKILLed;
    every later request is answered by the other one, which the router keeps, and its
    health shows the dead one down."""
    router, replicas = fleet
    first = chat(router, [{"role": "user", "content": "before the kill " * 4}])
    victim = next(r for r in replicas if r.url == first.headers[REPLICA])
    survivor = next(r for r in replicas if r is not victim)
    victim.proc.kill()
    victim.proc.wait()
    for i in range(4):  # the first may try the dead one, and is retried
        response = chat(router, [{"role": "user", "content": f"before the kill {i} " * 4}])
        assert response.status_code == 200, response.text
        assert response.headers[REPLICA] == survivor.url
    # a request that tried the dead one marked it down at once; if none did, the health
    # loop does within a few polls
    alive = lambda: {r["url"]: r["alive"] for r in health(router)["replicas"]}  # noqa: E731
    wait_for(lambda: alive()[victim.url] is False)
    assert alive() == {victim.url: False, survivor.url: True}
    page = parse_metrics(httpx.get(f"{router.url}/metrics", timeout=10).text)
    assert page["kvstore_router_retries_total"] <= 1  # at most the one that found it dead


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "the following arguments are required: --replica"),
        (["--replica", "engine-a:8000"], "replica: expected http://HOST:PORT"),
        (["--replica", "http://a:1", "--replica", "http://a:1"], "replica: each replica once"),
        (["--replica", "http://a:1", "--decode-weight", "-1"], "decode_weight must be"),
        (["--replica", "http://a:1", "--redis-block-cost", "2"], "redis_block_cost must be <= 1"),
        (["--replica", "http://a:1", "--policy", "random"], "invalid choice: 'random'"),
    ],
)
def test_bad_router_flags_fail_in_one_line(args, message):
    out = subprocess.run([kvstore_script(), "router", *args], capture_output=True, text=True,
                         timeout=60, env=clean_env())  # fmt: skip
    assert out.returncode == 2
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def footprint(pid: int) -> tuple[int, bool]:
    """(VmRSS in kB, whether libtorch is mapped) of a running process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE).group(1))
    return rss_kb, "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>")
def test_a_running_router_maps_no_torch_and_stays_small(fleet):
    router, _ = fleet
    rss_kb, torch_mapped = footprint(router.proc.pid)
    assert not torch_mapped and rss_kb <= ROUTER_MAX_RSS_KB, rss_kb
    for i in range(3):
        assert chat(router, [{"role": "user", "content": f"footprint {i} " * 20}]).is_success
    body = {"prompt": "stream", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=AUTH,
                      timeout=60) as response:  # fmt: skip
        assert response.status_code == 200 and list(response.iter_lines())[-2] == "data: [DONE]"
    rss_kb, torch_mapped = footprint(router.proc.pid)
    assert not torch_mapped and rss_kb <= ROUTER_MAX_RSS_KB, rss_kb


@pytest.mark.integration
def test_the_router_command_imports_no_torch():
    """What `kvstore router` imports, the tokenizer of `tiny` loaded: no torch, no engine."""
    code = (
        "import sys, engine.cli, engine.router.command, engine.router.app\n"
        "from engine.model.tokenizer import load_tokenizer_of\n"
        "load_tokenizer_of('tiny')\n"
        "heavy = {'torch', 'engine.loop.engine', 'engine.model.loading', 'engine.loop.request'}\n"
        "heavy &= set(sys.modules)\n"
        "print(sorted(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=clean_env())  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_the_tier_block_costs_are_router_flags():
    import argparse

    from engine.router.config import add_router_arguments, router_config_from_args

    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    argv = ["--replica", "http://a:1", "--host-block-cost", "0.02", "--redis-block-cost", "1"]
    routing = router_config_from_args(parser.parse_args(argv), env={}).routing
    costs = (routing.host_block_cost, routing.disk_block_cost, routing.redis_block_cost)
    assert costs == (0.02, 0.2, 1.0)


def test_a_prompt_just_routed_counts_as_held_before_its_events_arrive():
    """A chat's next turn, sent the moment its answer came, may beat that turn's events:
    the replica it went to is still the cheapest for it."""
    from engine.router.config import RouterConfig
    from engine.router.fleet import Fleet
    from kvstore.fleet.events import BlockSet, MediaBlocks

    class Quiet:  # a subscriber whose events have not come yet
        media = MediaBlocks(BlockSet())

        def stale(self, now: float, after: float) -> bool:
            return False

    fleet = Fleet(RouterConfig(replicas=("http://a:1", "http://b:1")))
    for replica in fleet.replicas:
        replica.alive, replica.events = True, Quiet()
    keys = [bytes([i]) * 16 for i in range(3)]
    fleet.sent(fleet.replicas[1], 3, keys[:2])
    fleet.replicas[1].sent.clear()  # its queue drained: only the held prefix differs
    chosen, choice = fleet.choose(4, keys)  # no namespace read yet: blocks of 1 token
    assert chosen is fleet.replicas[1] and choice.num_cached_tokens == 2


def test_a_prompt_stops_counting_as_queued_load_once_its_first_byte_came_back():
    from engine.router.config import RouterConfig
    from engine.router.fleet import Fleet

    fleet = Fleet(RouterConfig(replicas=("http://a:1",)))
    replica = fleet.replicas[0]
    first, second = fleet.sent(replica, 120, ()), fleet.sent(replica, 120, ())
    assert replica.load().queued_tokens == 240
    fleet.prefilled(replica, first)
    fleet.prefilled(replica, first)  # twice: nothing more to remove
    assert replica.load().queued_tokens == 120
    fleet.prefilled(replica, second)
    assert replica.load().queued_tokens == 0
    # asked before both were sent, answered after they came back: it may have counted them
    # while they were queued, and they are not queued now
    replica.report(0.0, {"queued_tokens": 300, "status": "ok"})
    assert replica.load().queued_tokens == 300 - 240
    third, fourth = fleet.sent(replica, 50, ()), fleet.sent(replica, 70, ())
    replica.report(time.monotonic(), {"queued_tokens": 400, "status": "ok"})  # counts both
    assert replica.load().queued_tokens == 400
    fleet.prefilled(replica, third)  # prefilled after that report was asked
    fleet.prefilled(replica, fourth, queued=False)  # refused there (429): never counted off
    assert replica.load().queued_tokens == 350
    replica.report(time.monotonic(), {"queued_tokens": 0, "status": "ok"})
    assert replica.load().queued_tokens == 0
