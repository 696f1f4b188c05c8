"""Prefill and decode replicas paired by the router (docs/DEPLOY.md "Prefill and decode
replicas").

A request's serving replica is chosen as always, among the replicas that decode (`decode` and
`both`; the `prefill` ones only when no other is up). When its prompt has at least
`handover_min_tokens` tokens that replica would have to compute (its cached prefix, by its
events, taken off), and (with `handover_max_queued_tokens`) some prefill replica queues fewer
prompt tokens than that (conditional disaggregation: an overloaded prefill tier gives the
work back to the decode replicas instead of queueing it), the router first sends the
prompt, as token ids with max_tokens 1, to a `prefill` replica that shares a tier with it,
chosen by cache overlap and load. That replica answers once the prompt's blocks are readable
from the shared tier; the request then goes to the serving replica with `HANDOVER_HEADER`,
loads the prompt from the tier, and streams the answer. A prefill replica that fails is
dropped and the next one tried; when none can take it, the serving replica computes the
prompt itself (`fallback`). The client sees one answer.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from engine.router.fleet import Fleet, Replica
from hashing import BlockHash
from kvstore.fleet.routing import load_cost

log = logging.getLogger("kvstore.router")
OUTCOMES = ("handed_over", "direct", "busy", "fallback")
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def shared_tiers(replica: Replica) -> frozenset[str]:
    """The identities of the tiers `replica` shares with other processes, by its /health."""
    tiers = (replica.info or {}).get("tiers") or ()
    return frozenset(
        t["shared"] for t in tiers if isinstance(t, dict) and isinstance(t.get("shared"), str)
    )


def prefill_body(model: str | None, token_ids: list[int], cache_salt: str | None) -> dict:
    """The prefill step: the prompt as the replicas render it, one token, not streamed."""
    body: dict[str, Any] = {"prompt": token_ids, "max_tokens": 1, "temperature": 0}
    if model is not None:
        body["model"] = model
    if cache_salt:
        body["cache_salt"] = cache_salt
    return body


def reported_cached(answer: httpx.Response) -> int:
    """The prefill replica's cached tokens (its usage); ValueError if it reports none."""
    details = (answer.json().get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
        raise ValueError(f"no cached_tokens in the prefill replica's usage: {details!r}")
    return cached


class _Refused(Exception):
    """A prefill replica refused the prompt itself (a 4xx other than 429): every other one
    would too; the serving replica answers the client with the reason."""


class Pairing:
    """Which replicas decode, and the prefill step of a request worth handing over."""

    def __init__(
        self,
        fleet: Fleet,
        client: httpx.AsyncClient,
        min_tokens: int,
        max_queued: int | None,
        registry: CollectorRegistry,
    ):
        self.fleet, self.client = fleet, client
        self.min_tokens, self.max_queued = min_tokens, max_queued
        self.outcomes = Counter("kvstore_router_handovers", "requests with a prefill replica "
                                "up, by how their prompt was computed (handed_over: on a "
                                "prefill replica; direct: too few uncached tokens; busy: "
                                "every prefill replica's queue was full; fallback: no "
                                "prefill replica could take it)", ["outcome"],
                                registry=registry)  # fmt: skip
        for outcome in OUTCOMES:
            self.outcomes.labels(outcome)
        self.seconds = Histogram("kvstore_router_handover_seconds", "the prefill step, from "
                                 "sending it to its answer", buckets=SECONDS_BUCKETS,
                                 registry=registry)  # fmt: skip
        self.retries = Counter("kvstore_router_prefill_retries", "prefill steps sent again "
                               "after a prefill replica failed or was full",
                               registry=registry)  # fmt: skip

    def not_serving(self) -> list[Replica]:
        """Replicas a request is not served on: the prefill ones, while another is up."""
        prefill = [r for r in self.fleet.replicas if r.role == "prefill"]
        others_up = any(r.alive and r.role != "prefill" for r in self.fleet.replicas)
        return prefill if others_up else []

    def candidates(self, serving: Replica, tried: list[Replica]) -> list[Replica]:
        """Live prefill replicas, not tried yet, that share a tier with `serving`."""
        return [
            r
            for r in self.fleet.replicas
            if r.alive and r.role == "prefill" and r not in tried and self.shares(r, serving)
        ]

    @staticmethod
    def shares(prefill: Replica, serving: Replica) -> bool:
        """Whether `serving` can read what `prefill` hands over (a tier both read)."""
        return bool(shared_tiers(prefill) & shared_tiers(serving))

    def with_room(self, candidates: list[Replica]) -> list[Replica]:
        """Those whose queue is under `max_queued` prompt tokens (all: no bound)."""
        bound = self.max_queued
        return [r for r in candidates if bound is None or r.load().queued_tokens < bound]

    def worth(self, serving: Replica, uncached: int) -> bool:
        """Whether to hand the prompt over to `serving`: it has `min_tokens` uncached there
        (else `direct`) and some prefill replica queues fewer than `max_queued` prompt
        tokens (else `busy`: past that, the wait there costs the request more than its
        prefill costs the decodes it would stall)."""
        candidates = [] if serving.role == "prefill" else self.candidates(serving, [])
        if not candidates:
            return False
        if uncached < self.min_tokens:
            self.outcomes.labels("direct").inc()
            return False
        if not self.with_room(candidates):
            self.outcomes.labels("busy").inc()
            return False
        return True

    async def prefill(
        self,
        token_ids: list[int],
        keys: list[BlockHash],
        req: Any,
        headers: dict[str, str],
        serving: Replica,
    ) -> tuple[int, Replica] | None:
        """Prefill the prompt on a prefill replica that shares a tier with `serving`: its
        cached tokens (what the client's usage reports) and the replica; None when none
        could (then `serving` computes it)."""
        body = json.dumps(prefill_body(req.model, token_ids, getattr(req, "cache_salt", None)))
        tried: list[Replica] = []
        start = time.perf_counter()
        while candidates := self.with_room(self.candidates(serving, tried)):
            replica = self._choose(len(token_ids), keys, candidates)
            try:
                cached = await self._send(replica, body.encode(), headers, len(token_ids), keys)
            except _Refused:
                break
            if cached is not None:
                self.outcomes.labels("handed_over").inc()
                self.seconds.observe(time.perf_counter() - start)
                return cached, replica
            tried.append(replica)
            self.retries.inc()
        self.outcomes.labels("fallback").inc()
        return None

    def _choose(self, num_tokens: int, keys: list[BlockHash], candidates: list) -> Replica:
        """The candidate where the prompt's first token comes soonest: the routing cost of
        its uncached and queued tokens and its running ones (whatever the router's policy:
        a round-robin position is the serving replicas', and stays theirs)."""
        weights = self.fleet.config.routing

        def cost(r: Replica) -> float:
            uncached = num_tokens - self.fleet.cached_tokens(r, num_tokens, keys)
            return weights.prefill_weight * uncached + load_cost(r.load(), weights)

        return min(candidates, key=cost)

    async def _send(
        self, replica: Replica, body: bytes, headers: dict, num_tokens: int, keys: list
    ) -> int | None:
        """The prefill step on `replica`: its cached tokens, or None when it failed (down:
        dropped), was full or could not hand over."""
        entry = self.fleet.sent(replica, num_tokens, keys)
        url = replica.url + "/v1/completions"
        try:
            answer = await self.client.post(url, content=body, headers=headers)
        except httpx.HTTPError as e:
            self.fleet.prefilled(replica, entry, queued=False)
            self.fleet.dead(replica, f"{type(e).__name__} on a prefill step")
            return None
        self.fleet.prefilled(replica, entry, queued=answer.status_code == 200)
        if answer.status_code == 503:  # closing, or its engine died
            self.fleet.dead(replica, "answered 503 to a prefill step")
        if answer.status_code != 200:
            log.warning("prefill replica %s answered %d", replica.url, answer.status_code)
            if 400 <= answer.status_code < 500 and answer.status_code != 429:
                raise _Refused
            return None
        try:
            return reported_cached(answer)
        except ValueError as e:
            log.warning("prefill replica %s: %s", replica.url, e)
            return None
