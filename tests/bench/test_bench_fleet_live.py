"""`bench fleet`'s accounting (the live runs themselves start replicas and a router: the
router's own tests in tests/server/test_router.py drive the same processes)."""

from __future__ import annotations

import pytest

from bench.fleet import build_parser, fleet_sessions, main
from bench.fleet.report import print_report, summarize
from bench.load.client import ChatOutcome


def outcome(ok: bool, text: str = "", ttft: float | None = 0.1, error: str = "") -> ChatOutcome:
    return ChatOutcome("u", ok, 200, ttft_s=ttft, prompt_tokens=100, cached_tokens=60,
                       completion_tokens=4, text=text, error=error)  # fmt: skip


def test_a_failure_after_streamed_text_is_partial_and_one_before_is_lost():
    outs = [outcome(True, "a"), outcome(True, "b"), outcome(False, "half", error="broke"),
            outcome(False, "", None, error="refused")]  # fmt: skip
    run = summarize(outs, 2.0, {"device": 90.0, "redis": 30.0}, [3, 1])
    assert (run["ok"], run["partial"], run["lost"]) == (2, 1, 1)
    assert run["errors"] == ["broke", "refused"]
    assert run["cached_share"] == 120 / 200
    assert run["device_share"] == 0.75
    assert run["max_over_mean"] == 1.5
    assert run["output_tok_per_s"] == 4.0


def test_the_report_compares_kv_with_round_robin_per_scenario():
    runs = []
    for route, ttft, device in [("kv", 0.5, 90.0), ("round-robin", 1.0, 45.0)]:
        run = summarize(
            [outcome(True, "x", ttft)], 1.0, {"device": device, "redis": 90 - device + 45}, [1, 1]
        )
        runs.append(run | {"scenario": "shared", "route": route, "killed": []})
    text = print_report({"runs": runs})
    assert "shared: kv / round-robin: TTFT p50 0.50x, device share of cached tokens 2.00x" in text


def test_every_session_has_a_document_of_its_own():
    args = build_parser().parse_args(["--sessions", "3", "--turns", "2", "--document-bytes", "100"])
    sessions = fleet_sessions(args)
    firsts = [s.questions[0] for s in sessions]
    assert len(set(firsts)) == 3 and all(len(f) > 100 for f in firsts)
    assert len({s.system for s in sessions}) == 1  # the system prompt is shared


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scenarios", "private,nope"], "unknown scenario 'nope'"),
        (["--replicas", "1"], "needs --replicas >= 2"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_host_tier_scenario_compares_the_kv_router_with_one_fed_device_events_only():
    runs = []
    for route, ttft, cached in [("kv", 0.3, 80.0), ("kv-device", 1.2, 20.0)]:
        run = summarize([outcome(True, "x", ttft)], 1.0, {"device": 10.0, "memory": cached}, [1])
        runs.append(run | {"scenario": "host-tiers", "route": route, "killed": []})
    assert "host-tiers: kv / kv-device: TTFT p50 0.25x" in print_report({"runs": runs})


def test_the_device_only_route_is_the_kv_router_with_spill_tier_events_ignored(tmp_path):
    from bench.fleet.cluster import FleetSpec, replica_command, router_command

    spec = FleetSpec(tmp_path, 3, 48, False, "kv-device", tmp_path, memory_cache_gb=0.5)
    router = router_command(spec, 9000, ["http://127.0.0.1:1"])
    assert router[router.index("--policy") + 1] == "kv" and "--device-events-only" in router
    replica = replica_command(spec, 9001, 9002, ["--memory-cache-gb", "0.5"])
    assert replica[replica.index("--device-blocks") + 1] == "48"
