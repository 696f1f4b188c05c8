"""Fault 8: bad input through the HTTP API. A live `kvstore serve` process gets hypothesis-
generated requests, each a valid request with exactly one invalidating mutation: every one
must get a 4xx, /health must answer 200 after each, and the cache index must not change.

The cases and their mutations are in cases.py and strategies.py, the server in server.py."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from bench.faults.common import Context, FaultOutcome
from bench.faults.http.cases import BODY_PATHS, Case, sweep
from bench.faults.http.server import INDEX, Server
from bench.faults.http.strategies import strategies

__all__ = ["INDEX", "PER_REQUEST", "http_fuzz", "strategies", "sweep"]

PER_REQUEST = 10  # generated requests per category = 10 x scale.requests
FUZZED_PATHS = {*BODY_PATHS, "/v1/models", "/metrics"}  # /health: no input

EXPECTED = {"keys": 401}  # the status each category must get; the exceptions by kind:
EXPECTED_KIND = {"unknown model": 404, "body bytes": 413}


def expected(case: Case) -> int:
    return EXPECTED_KIND.get(case.kind, EXPECTED.get(case.category, 400))


class Tally:
    """Sends cases; a case succeeds with its expected 4xx (400 for a bad body, 401 for a bad
    key, 404 for an unknown model, 413 for an oversized body) while the process lives and
    /health answers 200."""

    def __init__(self, server: Server):
        self.server, self.sent, self.ok, self.failures = server, 0, 0, []
        self.counts: Counter[str] = Counter()  # category_*, status_*

    def __call__(self, case: Case) -> None:
        status = self.server.send(case)
        ok = status == expected(case) and self.server.alive() and self.server.healthy()
        self.sent, self.ok = self.sent + 1, self.ok + ok
        self.counts.update([f"category_{case.category}", f"status_{status}"])
        if not ok and len(self.failures) < 5:
            self.failures.append(f"{case.category}/{case.kind} on {case.path}: {status}")


def fuzz(strategy: st.SearchStrategy[Case], n: int, tally: Tally) -> None:
    """Send `n` generated cases, recording each answer (nothing raises, so nothing shrinks)."""

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(case: Case) -> None:
        tally(case)

    run()


def http_fuzz(ctx: Context) -> FaultOutcome:
    """Every generated bad request gets a 4xx from a live server that stays healthy, and the
    index (device blocks, blocks stored, lookups, requests run) is the same afterwards."""
    n = PER_REQUEST * ctx.scale.requests
    with Server(ctx) as server:
        cold, hit = server.warm(), server.warm()
        before, tally = server.index(), Tally(server)
        for case in sweep():
            tally(case)
        for strategy in strategies(ctx).values():
            fuzz(strategy, n, tally)
        after, again = server.index(), server.warm()
        spec = server.client.get("/openapi.json")
    paths = set(spec.json()["paths"]) if spec.is_success else set()
    changed = sum(before[k] != after[k] for k in INDEX) + (again != hit or not hit)
    figures = {
        **dict(sorted(tally.counts.items())),
        "fields_swept": len(sweep()),
        **{f"{k}_before": v for k, v in before.items()},
        **{f"{k}_after": v for k, v in after.items()},
        "warm_cached_cold": cold,
        "warm_cached_before": hit,
        "warm_cached_after": again,
        "index_changed": changed,
        "openapi_paths": len(paths),
        "openapi_paths_fuzzed": len(paths & FUZZED_PATHS),
    }
    note = (
        f"{tally.ok}/{tally.sent} got their 4xx with /health 200 after; index series changed: "
        f"{changed}; warm prompt cached {hit} -> {again} tokens; the {len(paths)} OpenAPI "
        "paths list no body schemas (bodies are parsed by hand), so fields come from the "
        "request models; all paths but /health (no input) fuzzed"
    )
    return FaultOutcome(
        name="bad HTTP input (hypothesis)",
        injected=f"{n} generated requests per category (malformed JSON, wrong types, token ids, "
        "huge, salts, keys), each one invalidating mutation of a valid request, plus one "
        "wrong-typed value per documented field, to a live `kvstore serve`",
        requests=tally.sent,
        succeeded=tally.ok,
        wrong_outputs=tally.sent - tally.ok + changed,
        lost_entries=0,
        corrupt_injected=0,
        corrupt_detected=0,
        note="; ".join([note, *tally.failures]),
        figures=figures,
    )
