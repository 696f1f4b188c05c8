"""A replica's side of prefill/decode disaggregation (docs/DEPLOY.md "Prefill and decode
replicas"): roles, the hand-over a prefill replica makes before it answers, and the hand-overs
a decode replica takes.

- `prefill`: each non-streamed answer waits until the prompt's whole blocks are readable from
  the shared tier (`PrefixCache.hand_over`); the router sends it a prompt with max_tokens 1.
- `decode`: a request that carries `HANDOVER_HEADER` (the router's, with the prompt tokens
  the prefill replica had cached) loads the prompt from the shared tier like any tier hit.
  Its answer reports that count as `cached_tokens` (what one replica would have reported);
  what it loaded itself is counted here: `whole` when it missed at most the last block,
  `partial` (and the tokens it recomputed) otherwise.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.requests import Request as HTTPRequest

from engine.api.errors import bad_request
from engine.api.roles import HANDOVER_HEADER, ROLES
from engine.loop.request import GenerateResult, Request

if TYPE_CHECKING:
    from kvstore.cache import PrefixCache
    from kvstore.tiers.handover import HandOver

log = logging.getLogger("kvstore.server")
MAX_DIGITS = 12  # a count of tokens, not a number int() must parse at any length
HANDOVER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class ReplicaRole:
    """This replica's role: its metrics, and the hand-over of each side."""

    def __init__(self, role: str, cache: PrefixCache, registry: CollectorRegistry):
        self.cache, self.block_size = cache, cache.block_size
        self.hands_over = role == "prefill"  # each answered prompt, before its answer
        info = Gauge("kvstore_role", "this replica's role (1: the current one)", ["role"],
                     registry=registry)  # fmt: skip
        for name in ROLES:
            info.labels(name).set(int(name == role))
        self.blocks = Counter("kvstore_handover_blocks_total", "prefill side: prompt blocks "
                              "handed over, by state (present: the shared tier held them; "
                              "written: written from the device; missing: neither)", ["state"],
                              registry=registry)  # fmt: skip
        self.seconds = Histogram("kvstore_handover_seconds", "prefill side: the answer's wait "
                                 "for its prompt's blocks to be readable from the shared tier",
                                 buckets=HANDOVER_BUCKETS_S, registry=registry)  # fmt: skip
        self.received = Counter("kvstore_handovers_received_total", "decode side: handed-over "
                                "requests by what they loaded (whole: all but the last block)",
                                ["outcome"], registry=registry)  # fmt: skip
        self.recomputed = Counter("kvstore_handover_recomputed_tokens_total", "decode side: "
                                  "prompt tokens of whole blocks a hand-over lacked",
                                  registry=registry)  # fmt: skip
        for state in ("present", "written", "missing"):
            self.blocks.labels(state)
        for outcome in ("whole", "partial"):
            self.received.labels(outcome)

    def hand_over(self, job: Request) -> HandOver | None:
        """Make `job`'s prompt readable from the shared tier (a prefill replica's step before
        it answers: `hands_over`; blocking: run it off the event loop); None when it failed
        (logged: the answer stands, and the decode replica computes what it misses)."""
        start = time.perf_counter()
        prompt = job.token_ids
        keys = job.keys[: len(prompt) // self.block_size]
        try:
            done = self.cache.hand_over(prompt, job.cache_salt, keys)
        except Exception:  # a tier must never fail a request
            log.exception("hand-over of a %d-token prompt failed", len(prompt))
            return None
        self.seconds.observe(time.perf_counter() - start)
        for state in ("present", "written", "missing"):
            self.blocks.labels(state).inc(getattr(done, state))
        return done

    def receive(self, request: HTTPRequest, job: Request) -> None:
        """A request the router handed over (its header) is one: its answer reports the
        header's cached tokens, and its load is counted when it ends."""
        value = request.headers.get(HANDOVER_HEADER)
        if value is None:
            return
        if not value.isascii() or not value.isdigit() or len(value) > MAX_DIGITS:
            raise bad_request(f"header {HANDOVER_HEADER} must be a count of tokens, got "
                              f"{value[:40]!r}", HANDOVER_HEADER)  # fmt: skip
        job.handed_over = int(value)
        done = job.on_done

        def on_done(job: Request, result: GenerateResult | None) -> None:
            if done is not None:
                done(job, result)
            if result is not None:
                self.count(job)

        job.on_done = on_done

    def count(self, job: Request) -> None:
        """Whether a hand-over loaded every whole block of its prompt but the last."""
        prompt, cached = len(job.token_ids), job.num_cached_tokens
        self.received.labels("whole" if cached >= prompt - self.block_size else "partial").inc()
        self.recomputed.inc(max(0, prompt // self.block_size * self.block_size - cached))
