"""The router's pairing of prefill and decode replicas, on its own (the live fleet is
tests/server/test_router_handover.py): which replicas serve, when a prompt is worth handing
over, and a prefill step that fails over to the next prefill replica or falls back."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx

from engine.router.app import Router, _handover_headers
from engine.router.config import RouterConfig

SHARED = {"tiers": [{"name": "redis", "medium": "REDIS", "shared": "redis://r:6379/0"}]}
PRIVATE = {"tiers": [{"name": "memory", "medium": "HOST", "shared": None}]}
REQ = SimpleNamespace(model="m", cache_salt=None)


def fleet(
    *roles: str, min_tokens: int = 100, max_queued=None, answer=None, policy: str = "kv"
) -> Router:
    """A router over replicas http://<i>:1 with `roles`, all up and sharing one Redis;
    `answer(url)` answers (or fails) each prefill step."""
    urls = tuple(f"http://{i}:1" for i in range(len(roles)))
    config = RouterConfig(replicas=urls, handover_min_tokens=min_tokens, policy=policy,
                          handover_max_queued_tokens=max_queued)  # fmt: skip
    router = Router(config, None)
    for replica, role in zip(router.fleet.replicas, roles, strict=True):
        replica.alive, replica.role, replica.info = True, role, SHARED
    if answer is not None:

        def handler(request: httpx.Request) -> httpx.Response:
            return answer(str(request.url).removesuffix("/v1/completions"), request)

        router.pairing.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return router


def usage(cached: int) -> httpx.Response:
    return httpx.Response(200, json={"usage": {"prompt_tokens_details": {"cached_tokens": cached}}})


def outcomes(router: Router) -> dict[str, float]:
    return {
        o: router.metrics.registry.get_sample_value(
            "kvstore_router_handovers_total", {"outcome": o}
        )
        for o in ("handed_over", "direct", "busy", "fallback")
    }


def test_prefill_replicas_serve_no_request_while_another_replica_is_up():
    router = fleet("prefill", "decode", "both")
    assert [r.url for r in router.pairing.not_serving()] == ["http://0:1"]
    router.fleet.replicas[1].alive = router.fleet.replicas[2].alive = False
    assert router.pairing.not_serving() == []  # the prefill replica is all there is


def test_a_prompt_is_handed_over_only_past_the_threshold_and_through_a_shared_tier():
    router = fleet("prefill", "decode", min_tokens=100)
    prefill, decode = router.fleet.replicas
    assert router.pairing.worth(decode, 100)
    assert not router.pairing.worth(decode, 99)
    assert outcomes(router)["direct"] == 1
    decode.info = PRIVATE  # no tier in common with the prefill replica
    assert not router.pairing.worth(decode, 10_000)
    decode.info, prefill.alive = SHARED, False
    assert not router.pairing.worth(decode, 10_000)
    assert outcomes(router)["direct"] == 1  # neither counts: no prefill replica could


def test_with_a_queue_bound_a_prompt_stays_when_every_prefill_replica_is_full():
    router = fleet("prefill", "prefill", "decode", max_queued=1000)
    first, second, decode = router.fleet.replicas
    router.fleet.sent(first, 1000)
    assert router.pairing.worth(decode, 500)  # the second one has room
    router.fleet.sent(second, 1200)
    assert not router.pairing.worth(decode, 500)
    assert outcomes(router)["busy"] == 1
    unbounded = fleet("prefill", "decode")
    unbounded.fleet.sent(unbounded.fleet.replicas[0], 10**6)
    assert unbounded.pairing.worth(unbounded.fleet.replicas[1], 500)


def test_a_failed_prefill_replica_is_dropped_and_the_next_one_prefills():
    calls = []

    def answer(url: str, request: httpx.Request) -> httpx.Response:
        calls.append(url)
        if url == "http://0:1":
            raise httpx.ConnectError("refused", request=request)
        assert json.loads(request.content) == {"prompt": [1, 2, 3], "max_tokens": 1,
                                               "temperature": 0, "model": "m"}  # fmt: skip
        return usage(16)

    router = fleet("prefill", "prefill", "decode", answer=answer)
    first, second, decode = router.fleet.replicas
    handed = asyncio.run(router.pairing.prefill([1, 2, 3], [], REQ, {}, decode))
    assert handed == (16, second)
    assert sorted(calls) == ["http://0:1", "http://1:1"]
    assert not first.alive
    assert outcomes(router)["handed_over"] == 1
    assert router.metrics.registry.get_sample_value("kvstore_router_prefill_retries_total") == 1


def test_when_no_prefill_replica_can_take_it_the_serving_replica_computes_it():
    def answer(url: str, request: httpx.Request) -> httpx.Response:
        return httpx.Response(503 if url == "http://0:1" else 429, json={})

    router = fleet("prefill", "prefill", "decode", answer=answer)
    assert asyncio.run(router.pairing.prefill([1], [], REQ, {}, router.fleet.replicas[2])) is None
    assert outcomes(router)["fallback"] == 1
    assert not router.fleet.replicas[0].alive  # 503: closing or dead
    assert router.fleet.replicas[1].alive  # 429: full, not down


def test_a_prompt_a_prefill_replica_refuses_is_not_sent_to_another():
    calls = []

    def answer(url: str, request: httpx.Request) -> httpx.Response:
        calls.append(url)
        return httpx.Response(400, json={"error": {"message": "too long"}})

    router = fleet("prefill", "prefill", "decode", answer=answer)
    assert asyncio.run(router.pairing.prefill([1], [], REQ, {}, router.fleet.replicas[2])) is None
    assert len(calls) == 1
    assert outcomes(router)["fallback"] == 1


def test_prefill_steps_leave_round_robin_to_the_serving_replicas():
    router = fleet("prefill", "decode", "decode", min_tokens=0, policy="round-robin",
                   answer=lambda url, request: usage(0))  # fmt: skip
    served = []
    for _ in range(4):
        replica, cached = router._pick([1, 2, 3], [], None, router.pairing.not_serving())
        assert router.pairing.worth(replica, 3 - cached)
        assert asyncio.run(router.pairing.prefill([1, 2, 3], [], REQ, {}, replica))
        served.append(replica.url)
    assert served == ["http://1:1", "http://2:1"] * 2


def test_a_queue_bound_also_steers_the_prefill_step_to_a_replica_under_it():
    calls = []

    def answer(url: str, request: httpx.Request) -> httpx.Response:
        calls.append(url)
        return usage(0)

    router = fleet("prefill", "prefill", "decode", max_queued=4096, answer=answer)
    first, second, decode = router.fleet.replicas
    router.fleet.sent(first, 5000)  # over the bound, though the cheaper by overlap it may be
    router.fleet.sent(second, 4000)
    assert asyncio.run(router.pairing.prefill([1] * 8, [], REQ, {}, decode))[1] is second
    assert calls == ["http://1:1"]


def test_a_handed_over_request_reports_what_either_replica_held():
    headers, where = _handover_headers({"a": "b"}, (16, SimpleNamespace(url="http://p:1")), 48)
    assert headers == {"a": "b", "x-kvstore-handover": "48"}
    assert where == {"x-kvstore-prefill-replica": "http://p:1"}
    assert _handover_headers({"a": "b"}, None, 48) == ({"a": "b"}, {})


def test_a_retry_keeps_a_hand_over_only_on_a_replica_that_reads_its_tier():
    router = fleet("prefill", "decode", "decode")
    prefill, reads, cannot = router.fleet.replicas
    cannot.info = PRIVATE
    assert router.pairing.shares(prefill, reads)
    assert not router.pairing.shares(prefill, cannot)
