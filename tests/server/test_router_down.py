"""`kvstore router` when replicas go down: a replica that stops answering leaves routing and
the router's index (its /health row counts 0 blocks) while the others keep theirs, one that
answers again is indexed afresh by a replay of its events, and with no replica up the
router's /health answers 503."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_helpers import AUTH, cached_blocks, chat, indexed, replica_rows, running_fleet
from server_helpers import ServerProcess, parse_metrics, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def fleet(model_dir: Path, tmp_path: Path) -> Iterator[tuple[ServerProcess, list]]:
    """Two replicas with events behind a kv router, each holding blocks of its own prompt
    (sent to it directly), the router's index of each equal to its device index."""
    with running_fleet(model_dir, tmp_path) as (router, replicas):
        for i, replica in enumerate(replicas):
            body = {"prompt": f"replica {i} holds this prompt " * 3, "max_tokens": 2}
            answer = httpx.post(f"{replica.url}/v1/completions", json=body, headers=AUTH,
                                timeout=60)  # fmt: skip
            assert answer.status_code == 200, answer.text
        for replica in replicas:
            wait_for(lambda r=replica: indexed(router, r) == cached_blocks(r))
        yield router, replicas


def indexed_gauge(router: ServerProcess, replica: ServerProcess) -> float:
    page = parse_metrics(httpx.get(f"{router.url}/metrics", timeout=10).text)
    return page[f'kvstore_router_replica_indexed_blocks{{replica="{replica.url}"}}']


def test_a_dead_replicas_blocks_leave_the_index_and_no_replica_up_is_503(fleet):
    router, (victim, survivor) = fleet
    kept = cached_blocks(survivor)
    assert (indexed(router, victim), indexed(router, survivor)) == (cached_blocks(victim), kept)
    victim.proc.kill()
    victim.proc.wait()
    wait_for(lambda: replica_rows(router)[victim.url]["alive"] is False)
    rows = replica_rows(router)
    assert (rows[victim.url]["indexed_blocks"], indexed_gauge(router, victim)) == (0, 0.0)
    assert (rows[survivor.url]["alive"], rows[survivor.url]["indexed_blocks"]) == (True, kept)
    assert indexed_gauge(router, survivor) == kept
    degraded = httpx.get(f"{router.url}/health", timeout=10)
    assert (degraded.status_code, degraded.json()["status"]) == (200, "degraded")

    survivor.proc.kill()
    survivor.proc.wait()
    wait_for(lambda: httpx.get(f"{router.url}/health", timeout=10).status_code == 503)
    down = httpx.get(f"{router.url}/health", timeout=10).json()
    assert down["status"] == "unavailable"
    assert [(r["alive"], r["indexed_blocks"]) for r in down["replicas"]] == [(False, 0)] * 2
    refused = chat(router, [{"role": "user", "content": "anyone there?"}])
    assert refused.status_code == 503
    assert refused.json()["error"]["message"] == "no replica is up: retry later"


def test_a_replica_that_answers_again_is_indexed_again_by_its_events_replay(fleet):
    """SIGSTOP: its health reads time out, so it is dropped with its blocks; SIGCONT: it
    answers, and a new subscription replays its events into the same blocks."""
    router, (paused, other) = fleet
    held, kept = cached_blocks(paused), cached_blocks(other)
    os.kill(paused.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: replica_rows(router)[paused.url]["alive"] is False)
        rows = replica_rows(router)
        assert (rows[paused.url]["indexed_blocks"], rows[other.url]["indexed_blocks"]) == (0, kept)
    finally:
        os.kill(paused.proc.pid, signal.SIGCONT)
    wait_for(lambda: replica_rows(router)[paused.url]["events"] == "fresh")
    rows = replica_rows(router)
    assert rows[paused.url]["alive"] is True
    assert (rows[paused.url]["indexed_blocks"], rows[other.url]["indexed_blocks"]) == (held, kept)
    assert cached_blocks(paused) == held  # nothing changed there while it was away
