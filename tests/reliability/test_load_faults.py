"""The concurrent family of `python -m bench faults` (`load-*`) at CI scale: faults under
streaming clients on a live `kvstore serve`, each with its must-haves: 0 wrong outputs, 0
lost entries, 0 leaked blocks, integrity at close, every request answered or refused with a
documented status."""

import threading
from pathlib import Path

import pytest
import torch

from bench.faults.common import Context, Scale, micro_model
from bench.faults.concurrent import disconnects, redis_killed, sigterm, tenant_flood
from bench.faults.live import Streaming
from bench.faults.load_report import LoadOutcome, must_haves_hold
from engine.model.loading import LoadedModel

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

CI = Scale(requests=8, collision_trials=0, leak_requests=0, outage_s=0.5,
           load_clients=6, load_requests=12)  # fmt: skip


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    torch.set_num_threads(1)
    return micro_model()


@pytest.fixture
def ctx(model, redis_server, tmp_path: Path) -> Context:
    return Context(model, redis_server, tmp_path, CI)


def assert_clean(o: LoadOutcome) -> None:
    assert (o.wrong_outputs, o.lost_entries, o.failed, o.integrity_ok) == (0, 0, 0, True)
    assert must_haves_hold(o)


def test_redis_killed_mid_batch_costs_no_request_and_recovers(ctx):
    o = redis_killed(ctx)
    assert_clean(o)
    assert (o.sent, o.succeeded, o.refused, o.leaked_blocks) == (12, 12, {}, 0)
    assert o.recovery_s is not None  # /health said ok again after the restart


def test_clients_leaving_mid_stream_return_their_blocks_and_change_no_other_answer(ctx):
    o = disconnects(ctx)
    assert_clean(o)
    assert o.sent == 12 and o.leaked_blocks == 0
    assert o.succeeded + o.cancelled == 12  # 4 leave; one that read its whole answer first
    assert 1 <= o.cancelled <= 4  # finished normally


def test_sigterm_finishes_what_runs_and_refuses_the_rest_with_a_reason(ctx):
    o = sigterm(ctx)
    assert_clean(o)
    assert o.succeeded + sum(o.refused.values()) == o.sent == 12
    assert set(o.refused) <= {"draining", "closed unread"}
    assert o.figures["exit_s"] < 30  # the drain bound


def test_a_flooding_tenant_is_refused_before_a_quiet_one(ctx):
    o = tenant_flood(ctx)
    assert_clean(o)
    assert o.figures["b_refused"] == 0
    assert o.figures["displaced"] >= 1  # the queue was full when b came: a's gave way
    assert set(o.refused) == {"queue_full"}


def test_the_tally_counts_a_perturbed_answer_wrong_and_an_unexplained_error_failed(model):
    """Control: the checks above can fail."""
    from bench.faults.concurrent import prompts
    from bench.faults.live import Answer
    from bench.faults.load_report import MAX_TOKENS, Checks, tally
    from engine.loop.engine import Engine, SamplingParams
    from kvstore.config import CacheConfig

    prompt = prompts(1, seed=0)[0]
    with Engine(model, CacheConfig(block_size=4, device="cpu", device_blocks=64)) as engine:
        ids = engine.generate([prompt], SamplingParams(max_new_tokens=MAX_TOKENS))[0]
    good = Answer(prompt, 0.0, status=200, ttft_s=0.01, token_ids=ids.output_token_ids)
    bad = Answer(
        prompt,
        0.0,
        status=200,
        ttft_s=0.01,
        token_ids=[(ids.output_token_ids[0] + 1) % 256, *ids.output_token_ids[1:]],
    )
    broken = Answer(prompt, 0.0, status=200, error="server_error")
    checks = Checks(leaked_blocks=0, integrity_ok=True, lost_entries=0, lost_note="")
    o = tally(model, [good], [good, bad, broken], checks, name="control", injected="none")
    assert (o.succeeded, o.wrong_outputs, o.failed) == (2, 1, 1)
    assert not must_haves_hold(o)


def test_the_soak_fails_on_heap_growth_of_5_percent_or_any_descriptor_or_thread_growth():
    from dataclasses import replace

    from bench.faults.soak import Sample, SoakReport, holds, markdown, verdict

    warm = Sample(rss_mib=300.0, rss_file_mib=128.0, fds=13, threads=9)
    ok = SoakReport(
        seconds=600,
        clients=16,
        answers=100,
        succeeded=90,
        refused=5,
        left=5,
        failed=0,
        wrong_outputs=0,
        faults={"redis-kill": 2},
        warm=warm,
        end=replace(warm, rss_mib=314.0),
        leaked_blocks=0,
        integrity_ok=True,
    )
    assert holds(ok)
    assert "300 -> 314 (+4.7%)" in markdown(ok, "python -m bench faults --soak 600")
    assert verdict(replace(ok, end=replace(warm, rss_mib=320.0))).endswith(
        "**missed**: RSS anon grew +6.7%."
    )
    assert not holds(replace(ok, end=replace(warm, rss_mib=315.0)))  # +5.0%
    assert not holds(replace(ok, end=replace(warm, fds=14)))
    assert not holds(replace(ok, end=replace(warm, threads=10)))
    assert not holds(replace(ok, failed=1))


def test_a_fault_waits_for_streams_running_at_once_as_the_clients_see_them() -> None:
    """`Streaming` (what `busy()` waits on first): counts streams between their first chunk
    and their end, wakes a waiter the moment enough run at once, and keeps that they did
    (a waiter woken late must not miss a peak that has passed) until the next `mark`."""
    streaming = Streaming()
    assert not streaming.wait_for(1, 0.01)
    started = threading.Timer(0.05, streaming.change, args=(1,))
    started.start()
    assert streaming.wait_for(1, 10.0)  # woken by the change, long before the timeout
    streaming.change(1)
    streaming.change(-1)
    assert streaming.wait_for(2, 0.0)  # two ran at once, though one has ended since
    streaming.mark()  # an earlier batch's peak no longer counts; the one running does
    assert streaming.wait_for(1, 0.0) and not streaming.wait_for(2, 0.01)
    streaming.change(1)
    assert streaming.wait_for(2, 0.0)
    started.join()
