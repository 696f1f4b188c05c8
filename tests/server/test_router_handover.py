"""Prefill and decode replicas behind `kvstore router`, handing prompts over through a real
Redis: a long prompt is prefilled on the prefill replica and decoded on a decode replica that
loads it from the tier, and the client sees one answer, identical to a single replica's, with
the usage one replica would report. A short prompt goes straight to a decode replica."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_helpers import AUTH, BLOCK, REPLICA, health, start_replica, start_router
from server_helpers import ServerProcess, wait_for

from engine.api.roles import PREFILL_REPLICA_HEADER

MIN_TOKENS = 64  # the router's --handover-min-tokens here
DAMAGED = 'kvstore_verify_failures_total{reason="checksum",tier="redis"}'


@pytest.fixture(scope="module")
def split_fleet(model_dir: Path, tmp_path_factory, module_redis) -> Iterator[dict]:
    """One prefill replica and two decode replicas over a Redis, and a router."""
    base, redis = tmp_path_factory.mktemp("handover"), module_redis
    tier = ("--redis-url", redis.url)
    procs = {
        "prefill": start_replica(model_dir, base, "prefill", *tier, "--role", "prefill"),
        "decode-a": start_replica(model_dir, base, "decode-a", *tier, "--role", "decode"),
        "decode-b": start_replica(model_dir, base, "decode-b", *tier, "--role", "decode"),
    }
    router = None
    try:
        for proc in procs.values():
            proc.start()
        for proc in procs.values():
            proc.wait_ready()
        urls = [p.url for p in procs.values()]
        router = start_router(model_dir, base, urls, "--handover-min-tokens", str(MIN_TOKENS))
        router.start().wait_ready()
        wait_for(lambda: all(r["events"] == "fresh" for r in health(router)["replicas"]))
        yield {"router": router, "redis": redis, **procs}
    finally:
        for proc in [router, *procs.values()]:
            if proc is not None:
                proc.stop()


def complete(server: ServerProcess, prompt: str, headers=AUTH, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True} | extra
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=120)


def reference(fleet: dict, prompt: str) -> str:
    """The answer of one replica computing the prompt from scratch (a salt of its own)."""
    answer = complete(fleet["decode-b"], prompt, cache_salt="reference")
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return answer.json()["choices"][0]["text"]


def handovers(replica: ServerProcess) -> dict[str, float]:
    m = replica.metrics()
    return {
        o: m[f'kvstore_handovers_received_total{{outcome="{o}"}}'] for o in ("whole", "partial")
    }


def router_outcomes(router: ServerProcess) -> dict[str, float]:
    m = router.metrics()
    return {o: m[f'kvstore_router_handovers_total{{outcome="{o}"}}']
            for o in ("handed_over", "direct", "fallback")}  # fmt: skip


def test_each_replica_shows_its_role_on_health_and_metrics(split_fleet):
    for name in ("prefill", "decode-a", "decode-b"):
        replica = split_fleet[name]
        role = name.split("-")[0]
        assert health(replica)["role"] == role
        assert replica.metrics()[f'kvstore_role{{role="{role}"}}'] == 1.0
    rows = {r["url"]: r["role"] for r in health(split_fleet["router"])["replicas"]}
    assert sorted(rows.values()) == ["decode", "decode", "prefill"]


def test_a_long_prompt_is_prefilled_on_the_prefill_replica_and_decoded_on_a_decode_one(
    split_fleet,
):
    router, prefill = split_fleet["router"], split_fleet["prefill"]
    prompt = "a long prompt handed over " * 8  # 208 tokens: 52 whole blocks
    want = reference(split_fleet, prompt)
    before = router_outcomes(router)
    answer = complete(router, prompt)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == want
    # the client's usage is one replica's: nothing of this prompt was cached before it
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert answer.headers[PREFILL_REPLICA_HEADER] == prefill.url
    decode = next(split_fleet[n] for n in ("decode-a", "decode-b")
                  if split_fleet[n].url == answer.headers[REPLICA])  # fmt: skip
    assert handovers(decode)["whole"] >= 1
    after = router_outcomes(router)
    assert after["handed_over"] == before["handed_over"] + 1
    m = prefill.metrics()
    assert m['kvstore_handover_blocks_total{state="missing"}'] == 0


def test_a_handed_over_prompt_loads_from_the_shared_tier_on_the_decode_replica(split_fleet):
    router = split_fleet["router"]
    prompt = "the decode replica loads every block but the last " * 4
    decoders = [split_fleet["decode-a"], split_fleet["decode-b"]]
    hits = [r.metrics().get('kvstore_prefix_cache_hits_tokens_total{tier="redis"}', 0.0)
            for r in decoders]  # fmt: skip
    answer = complete(router, prompt)
    assert answer.status_code == 200, answer.text
    i = [r.url for r in decoders].index(answer.headers[REPLICA])
    got = decoders[i].metrics()['kvstore_prefix_cache_hits_tokens_total{tier="redis"}']
    whole = answer.json()["usage"]["prompt_tokens"] // BLOCK * BLOCK
    assert got - hits[i] == whole  # every whole block, from Redis


def test_a_streamed_chat_is_handed_over_with_one_answer_and_its_usage(split_fleet):
    router = split_fleet["router"]
    messages = [{"role": "user", "content": "stream this long question, please " * 6}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    url = f"{split_fleet['decode-b'].url}/v1/chat/completions"
    plain = httpx.post(url, json=body | {"cache_salt": "reference"}, headers=AUTH, timeout=120)
    want = plain.json()["choices"][0]["message"]["content"]
    stream = body | {"stream": True, "stream_options": {"include_usage": True}}
    text, usage = "", None
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=stream, headers=AUTH,
                      timeout=120) as response:  # fmt: skip
        assert response.status_code == 200
        assert PREFILL_REPLICA_HEADER in response.headers
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    text += (choice.get("delta") or {}).get("content") or ""
                usage = chunk.get("usage") or usage
    assert text == want
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]


def test_an_anthropic_message_is_handed_over_too(split_fleet):
    router = split_fleet["router"]
    before = router_outcomes(router)["handed_over"]
    model = health(split_fleet["decode-a"])["model"]
    body = {"model": model, "max_tokens": 5, "temperature": 0,
            "messages": [{"role": "user", "content": "an anthropic question " * 8}]}  # fmt: skip
    headers = AUTH | {"anthropic-version": "2023-06-01"}
    answer = httpx.post(f"{router.url}/v1/messages", json=body, headers=headers, timeout=120)
    assert answer.status_code == 200, answer.text
    # the chat template's first block, which the prefill replica holds from the chat above:
    # what one replica would report
    assert answer.json()["usage"]["cache_read_input_tokens"] == BLOCK
    assert router_outcomes(router)["handed_over"] == before + 1


def test_a_short_prompt_goes_straight_to_a_decode_replica(split_fleet):
    router = split_fleet["router"]
    before = router_outcomes(router)
    answer = complete(router, "short")
    assert answer.status_code == 200, answer.text
    assert PREFILL_REPLICA_HEADER not in answer.headers
    assert answer.headers[REPLICA] != split_fleet["prefill"].url
    after = router_outcomes(router)
    assert (after["direct"], after["handed_over"]) == (before["direct"] + 1, before["handed_over"])


@pytest.mark.parametrize("session", [None, "chat-1"])
def test_a_chats_next_turn_with_a_short_new_part_is_not_handed_over_again(split_fleet, session):
    """Its earlier turns are in the shared tier and on its replica: what is left to compute
    is short (with a session header too: its pinned replica's cached prefix counts)."""
    router = split_fleet["router"]
    extra = {"headers": AUTH | {"x-session-id": session}} if session else {}
    prompt = f"a conversation ({session}) that grows by a little each turn " * 4
    first = complete(router, prompt, **extra)
    assert PREFILL_REPLICA_HEADER in first.headers
    wait_for(lambda: all(r["events"] == "fresh" for r in health(router)["replicas"]))
    before = router_outcomes(router)
    second = complete(router, prompt + first.json()["choices"][0]["text"] + " and more", **extra)
    assert second.status_code == 200, second.text
    assert PREFILL_REPLICA_HEADER not in second.headers
    assert router_outcomes(router)["direct"] == before["direct"] + 1
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > len(prompt) // 2


def test_a_handover_header_that_is_not_a_count_is_refused_with_400(split_fleet):
    decode = split_fleet["decode-a"]
    body = {"prompt": "x", "max_tokens": 1}
    for value in ("-1", "1e3", "9" * 5000):
        answer = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=60,
                            headers=AUTH | {"x-kvstore-handover": value})  # fmt: skip
        assert answer.status_code == 400, value[:20]
        assert "x-kvstore-handover" in answer.json()["error"]["message"]


def test_damaged_handed_over_blocks_are_recomputed_and_counted_on_the_decode_replica(
    split_fleet,
):
    """The two steps by hand, with the prompt's new entries damaged in between: the decode
    replica verifies, finds the damage, recomputes from there and answers the same."""
    prefill, decode = split_fleet["prefill"], split_fleet["decode-a"]
    prompt = "each of these blocks gets a flipped bit in the tier " * 4
    want = reference(split_fleet, prompt)
    admin = split_fleet["redis"].client()
    before = set(admin.keys("*"))
    first = complete(prefill, prompt, max_tokens=1)
    assert first.status_code == 200, first.text
    new = set(admin.keys("*")) - before  # the prompt's blocks, one entry each
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    assert len(new) == prompt_tokens // BLOCK
    for name in new:
        value = bytearray(admin.get(name))
        value[-3] ^= 0x10  # one payload bit
        admin.set(name, bytes(value))
    failures = decode.metrics().get(DAMAGED, 0.0)
    received = handovers(decode)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=120,
                        headers=AUTH | {"x-kvstore-handover": "0"})  # fmt: skip
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == want
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert decode.metrics()[DAMAGED] == failures + 1
    after = handovers(decode)
    assert (after["whole"], after["partial"]) == (received["whole"], received["partial"] + 1)
