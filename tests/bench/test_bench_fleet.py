"""Replica fleets (routing, derived sessions, the service model), the cost model, and `bench
hitrate`'s planning flags."""

import dataclasses
import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from bench_helpers import traces
from hypothesis import given, settings

from bench.hitrate import fleet as fleet_module
from bench.hitrate import main
from bench.hitrate.cost import CostModel
from bench.hitrate.fleet import (
    ROUTES,
    FleetConfig,
    ServiceModel,
    ServiceQueue,
    derive_sessions,
    make_replicas,
    replay_fleet,
)
from bench.hitrate.offline import infinite_hits
from bench.hitrate.tiers import TierConfig, block_requests, key_blob
from bench.traces import BlockTrace, from_chains, load_trace
from kvstore.fleet.events import TIER_MEDIUM, BlockRemoved, BlockSet
from kvstore.fleet.routing import ReplicaLoad, RoutingConfig
from kvstore.index.policies import LRUPolicy

FIXTURES = Path(__file__).resolve().parents[2] / "bench" / "fixtures"
TOKEN_FIXTURE = FIXTURES / "conversation_tokens.jsonl"
MOONCAKE_FIXTURE = FIXTURES / "conversation_mooncake.jsonl"

# a system prompt S = block 0; session A: [S, a1], later [S, a1, a2]; session B: [S, b1],
# then [S, b1, b2]; arrivals A1, B1, B2, A2; then a one-off C with nothing shared
TWO_SESSIONS = [[0, 1], [0, 2], [0, 2, 3], [0, 1, 4], [5, 6]]


def fixture_head(requests: int) -> BlockTrace:
    trace = load_trace(MOONCAKE_FIXTURE)
    return from_chains([trace.request(r) for r in range(requests)], block_tokens=512)


def routed(trace: BlockTrace, config: FleetConfig) -> tuple[list[int], list[int]]:
    """(replica of each request, block hits of each request)."""
    replicas: list[int] = []
    hits: list[int] = []

    def record(r: int, replica: int, tier_hits: list[int]) -> None:
        replicas.append(replica)
        hits.append(sum(tier_hits))

    replay_fleet(trace, config, on_request=record)
    return replicas, hits


# the cost as the tests below compute it: a device block worth only the prefill it saves
# (device_affinity is tested in tests/core/test_routing.py)
NO_AFFINITY = RoutingConfig(device_affinity=0.0)


def fleet(
    replicas: int,
    route: str,
    device: int = 10,
    spill=(),
    service: ServiceModel | None = None,
    routing: RoutingConfig | None = None,
) -> FleetConfig:
    return FleetConfig(
        TierConfig(device, spill),
        "lru",
        replicas,
        route,
        routing or NO_AFFINITY,
        service or ServiceModel(),
    )


def arriving(trace: BlockTrace, times_ms: list[float]) -> BlockTrace:
    return dataclasses.replace(trace, timestamps=np.asarray(times_ms, dtype=np.float64))


ONE_MS = ServiceModel(1.0, 0.0)  # a request holds its replica 1 ms per uncached token
IDLE = ServiceModel(0.0, 0.0)  # no request waits: every replica is always idle


# --- sessions ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("chains", "sessions"),
    [
        (TWO_SESSIONS, [0, 1, 1, 0, 2]),
        ([[0], [0, 1], [0, 2]], [0, 0, 1]),  # the second branch off [0] is a new session
        ([[0, 1], [0, 1], [0, 1, 2]], [0, 0, 0]),  # a resent prompt, then the next turn
        ([[0, 1], [0, 1, 2], [0, 1, 3]], [0, 0, 1]),  # a regenerated turn starts a new one
        ([[0, 1, 2], [0, 1], [0, 1, 3]], [0, 1, 2]),  # a prefix of a turn ends nothing
        ([[], [0], []], [0, 1, 2]),
    ],
)
def test_sessions_follow_a_request_that_resends_a_whole_earlier_prompt(chains, sessions):
    assert derive_sessions(from_chains(chains)).tolist() == sessions


def test_a_shared_system_prompt_does_not_merge_sessions_on_the_fixture():
    trace = load_trace(MOONCAKE_FIXTURE)
    sessions = derive_sessions(trace)
    assert sessions[:3].tolist() == [0, 1, 2]  # three first turns behind system prompt 0, 60
    counts = np.bincount(sessions)
    assert counts.max() < 20  # no session swallows the conversations sharing a prompt


# --- routing -------------------------------------------------------------------------------
def test_round_robin_alternates_replicas_and_splits_the_sessions():
    assert routed(from_chains(TWO_SESSIONS), fleet(2, "round-robin")) == (
        [0, 1, 0, 1, 0],
        [0, 0, 1, 1, 0],
    )


def test_session_routing_keeps_each_session_on_its_replica():
    # A on replica 0, B on the least loaded (1); C starts on the least loaded (0: 2 vs 2)
    assert routed(from_chains(TWO_SESSIONS), fleet(2, "session")) == (
        [0, 1, 1, 0, 0],
        [0, 0, 2, 2, 0],
    )


def test_kv_spreads_requests_that_share_only_a_first_block():
    # eight prompts of 9 tokens behind one shared block (4 tokens), 1 ms apart, at 1 ms a token:
    # a replica holding block 0 saves 4 tokens, less than a queued request costs (5), so the
    # second prompt joins the first one's replica and the third goes to an idle one
    trace = from_chains([[0, i + 1] for i in range(8)], block_tokens=4)
    config = fleet(4, "kv", service=ONE_MS)
    assert routed(trace, config) == ([0, 0, 1, 1, 2, 2, 3, 3], [0, 1, 0, 1, 0, 1, 0, 1])
    result = replay_fleet(trace, config)
    assert result.routed == [2, 2, 2, 2]
    assert result.mean_wait_ms == 4.0  # each second request waits 8 ms behind the first one


def test_kv_keeps_a_session_on_the_replica_holding_its_history_when_loads_are_equal():
    # A1 and B1 arrive together and split; at t=1 both replicas run a 9-token prompt, so A2
    # and B2 go where their history is (A2 first, and it then adds to replica 0's queue)
    trace = arriving(
        from_chains([[0, 1], [2, 3], [0, 1, 4], [2, 3, 5]], block_tokens=4), [0, 0, 1, 1]
    )
    assert routed(trace, fleet(2, "kv", service=ONE_MS)) == ([0, 1, 0, 1], [0, 0, 2, 2])


def test_kv_with_idle_replicas_routes_by_the_longest_prefix_then_by_requests_routed():
    # no load: B1 shares S with A1's replica 0, so everything but the unrelated C goes there;
    # C holds nothing anywhere and goes to the replica with fewer requests
    assert routed(from_chains(TWO_SESSIONS), fleet(2, "kv", service=IDLE)) == (
        [0, 0, 0, 0, 1],
        [0, 1, 2, 2, 0],
    )


@pytest.mark.parametrize(("decode_weight", "moves_at"), [(0.1, 4), (0.0, 4), (0.5, 3)])
def test_a_busy_replica_loses_to_an_idle_one_once_its_queue_outweighs_the_overlap(
    decode_weight, moves_at
):
    # every prompt extends [0, 1, 2] (12 of its 17 tokens cached on replica 0) and arrives
    # 1 ms after the one before, while replica 0 still runs the first (13 tokens, 13 ms).
    # Replica 0 costs 5 + 5 * queued + decode_weight * 13 against 17 on the idle replica 1:
    # 6.3, 11.3, 16.3, then 21.3 with the default weights; 11.5, 16.5, then 21.5 with 0.5
    trace = from_chains([[0, 1, 2], *[[0, 1, 2, i] for i in range(3, 7)]], block_tokens=4)
    routing = RoutingConfig(1.0, decode_weight, device_affinity=0.0)
    config = fleet(2, "kv", service=ONE_MS, routing=routing)
    replicas, _ = routed(trace, config)
    assert replicas == [0] * moves_at + [1] * (5 - moves_at)


def test_control_a_fleet_that_ignored_routing_would_hit_like_one_cache():
    # every request on one replica: round-robin's 2 and session's 4 hits above are routing
    assert routed(from_chains(TWO_SESSIONS), fleet(1, "round-robin")) == (
        [0, 0, 0, 0, 0],
        [0, 1, 2, 2, 0],
    )


def test_kv_routing_records_no_hit_on_any_replica():
    # the fixture's routed requests, replayed again on fresh replicas with the same assignment
    # and no router: the policies see the same hits, and the same number of them (a route
    # that looked into an index could record a hit on every replica holding part of a prompt)
    trace = fixture_head(600)
    config = FleetConfig(TierConfig(60, (("memory", 100),)), "lru", 3, "kv")
    original = LRUPolicy.access
    with mock.patch.object(LRUPolicy, "access", autospec=True, side_effect=original) as access:
        assignment, hits = routed(trace, config)
        probed = access.call_count
        access.reset_mock()
        replicas = make_replicas(config, trace.num_unique)
        unprobed = [
            sum(replicas[i].serve(req))
            for i, req in zip(assignment, block_requests(trace), strict=True)
        ]
        assert access.call_count == probed > 0
    assert sorted(set(assignment)) == [0, 1, 2]
    assert unprobed == hits


def replay_watching_events(trace: BlockTrace, config: FleetConfig, check) -> fleet_module.Fleet:
    """Replay `trace`, calling `check(fleet)` after every request; returns the fleet."""
    made: list[fleet_module.Fleet] = []
    original = fleet_module.make_fleet

    def make(config: FleetConfig, num_unique: int) -> fleet_module.Fleet:
        made.append(original(config, num_unique))
        return made[-1]

    with mock.patch.object(fleet_module, "make_fleet", side_effect=make):
        replay_fleet(trace, config, on_request=lambda r, i, hits: check(made[0]))
    return made[0]


def index_keys(replica, num_unique: int) -> set[bytes]:
    blob = key_blob(num_unique)
    return {blob[b * 16 : (b + 1) * 16] for b in replica.index.all_block_ids()}


def assert_views_hold_what_each_tier_holds(fleet: fleet_module.Fleet, num_unique: int) -> None:
    """Every replica's view: its device index, and each spill tier by its medium."""
    blob = key_blob(num_unique)
    for replica, view in zip(fleet.replicas, fleet.views, strict=True):
        assert view.device.blocks == index_keys(replica, num_unique)
        assert len(view.tiers) == len(replica.stores)
        for store in replica.stores:
            held = {blob[b * 16 : (b + 1) * 16] for b in np.flatnonzero(store.present).tolist()}
            assert view.tiers[TIER_MEDIUM[store.name]].blocks == held


def test_the_block_sets_built_from_events_equal_each_replicas_index_through_evictions():
    trace = fixture_head(600)
    config = FleetConfig(TierConfig(60, (("memory", 150), ("redis", 400))), "lru", 3, "kv")

    def check(fleet: fleet_module.Fleet) -> None:
        assert_views_hold_what_each_tier_holds(fleet, trace.num_unique)

    original = BlockSet.apply
    with mock.patch.object(BlockSet, "apply", autospec=True, side_effect=original) as apply:
        done = replay_watching_events(trace, config, check)
    removed = [c for c in apply.call_args_list if isinstance(c.args[1], BlockRemoved)]
    assert len(removed) > 100  # the devices of 60 blocks evicted all along
    assert [len(view.device) for view in done.views] == [60, 60, 60]
    assert [len(view.tiers["HOST"]) for view in done.views] == [150, 150, 150]
    redis = {id(view.tiers["REDIS"]) for view in done.views}
    assert len(redis) == 1  # one shared set: every replica reads the one Redis
    assert len(done.views[0].tiers["REDIS"]) == 400
    assert sum(p.routed for p in done.replicas) == 600


@pytest.mark.parametrize("replicas", [2, 3])
@settings(max_examples=25, derandomize=True, deadline=None)
@given(trace=traces())
def test_event_block_sets_track_the_indexes_on_small_traces(replicas, trace):
    config = fleet(replicas, "kv", 3, (("memory", 4), ("lmdb", 9)), service=ONE_MS)

    def check(fleet: fleet_module.Fleet) -> None:
        assert_views_hold_what_each_tier_holds(fleet, trace.num_unique)

    replay_watching_events(trace, config, check)


# --- service model -------------------------------------------------------------------------
def test_a_service_queue_serves_one_request_at_a_time_in_arrival_order():
    queue = ServiceQueue()
    assert queue.add(0.0, 5, 9, 9.0) == 0.0  # runs 0-9
    assert queue.add(1.0, 4, 13, 4.0) == 8.0  # waits for it: runs 9-13
    assert queue.add(2.0, 6, 7, 0.0) == 11.0  # no service time: starts and ends at 13
    assert queue.load(2.0, 3) == ReplicaLoad(10, 9, 3)  # two not started, the first running
    assert queue.load(9.0, 3) == ReplicaLoad(6, 13, 3)
    assert queue.load(13.0, 3) == ReplicaLoad(0, 0, 3)  # all done by 13
    assert queue.add(20.0, 2, 2, 1.0) == 0.0  # idle: starts at its arrival
    assert queue.load(20.5, 4) == ReplicaLoad(0, 2, 4)


def test_service_time_is_prefill_of_the_uncached_tokens_plus_decode_of_the_outputs():
    # one replica, one 9-token prompt twice: the second one has 4 tokens cached; outputs 10, 0
    trace = from_chains([[0, 1], [0, 1]], block_tokens=4)
    config = fleet(1, "round-robin", service=ServiceModel(2.0, 0.5))
    result = replay_fleet(trace, config, output_tokens=np.array([10, 0]))
    # the first runs 0-23 (2 * 9 + 0.5 * 10); the second arrives at 1 and waits 22 ms
    assert result.mean_wait_ms == 11.0
    with pytest.raises(ValueError, match="2 output lengths for 3 requests"):
        replay_fleet(from_chains([[0], [1], [2]]), config, output_tokens=np.array([1, 2]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill_ms_per_token": -1.0}, "prefill_ms_per_token must be a finite number >= 0"),
        ({"decode_ms_per_token": float("nan")}, "decode_ms_per_token must be a finite"),
        ({"decode_ms_per_token": True}, "decode_ms_per_token must be a number"),
    ],
)
def test_a_bad_service_model_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServiceModel(**kwargs)


def test_the_prefix_route_is_gone_and_says_what_replaced_it():
    with pytest.raises(ValueError, match="route 'prefix' was replaced by 'kv'"):
        fleet(2, "prefix")
    assert "prefix" not in ROUTES


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("replicas", [2, 3, 4])
@settings(max_examples=25, derandomize=True, deadline=None)
@given(trace=traces())
def test_replicas_sharing_an_unbounded_redis_reach_the_single_cache_infinite_rate(
    route, replicas, trace
):
    device = max(1, 2 * int(np.diff(trace.offsets).max()))  # takes any whole prompt
    config = fleet(replicas, route, device, (("redis", max(1, trace.num_unique)),))
    assert sum(routed(trace, config)[1]) == infinite_hits(trace)


@pytest.mark.parametrize("route", ROUTES)
def test_replicas_sharing_an_unbounded_redis_reach_the_infinite_rate_on_the_fixture(route):
    trace = load_trace(MOONCAKE_FIXTURE)
    spill = (("memory", 100), ("redis", trace.num_unique))
    config = fleet(4, route, 2 * int(np.diff(trace.offsets).max()), spill)
    result = replay_fleet(trace, config)
    assert sum(result.tier_block_hits.values()) == infinite_hits(trace) == 16459
    assert sum(result.routed) == trace.num_requests


# --- cost model ----------------------------------------------------------------------------
def test_estimated_ttft_charges_prefill_per_uncached_token_and_load_per_hit_block():
    cost = CostModel(0.5, (("device", 0.25), ("memory", 2.0)))
    # two requests of 33 and 17 tokens; 3 device hits and 1 memory hit of 8-token blocks
    ttft = cost.mean_ttft_s({"device": 3, "memory": 1}, 50, 2, 8)
    assert ttft == pytest.approx((0.5 * (50 - 32) + 0.75 + 2.0) / 2 / 1000)
    assert cost.mean_nocache_s(50, 2) == pytest.approx(0.5 * 50 / 2 / 1000)


def test_the_cost_model_needs_a_load_cost_for_every_tier_it_is_used_with():
    cost = CostModel.parse(1.0, "device=0", ("device", "memory"))
    with pytest.raises(ValueError, match=r"no cost for \['memory'\]: add memory=MS"):
        cost.check_covers(("device", "memory"))


# --- command line --------------------------------------------------------------------------
PLAN_FIELDS = {
    "replicas",
    "route",
    "tier_capacity_blocks",
    "tier_block_hit_rate",
    "tier_block_hits",
    "tier_token_hit_rate",
    "write_policy",
    "requests_per_replica",
    "routed_max_to_mean",
    "est_queue_wait_s",
    "service_model",
    "routing",
}
PLAIN_FIELDS = {
    "policy",
    "capacity_blocks",
    "block_hit_rate",
    "token_hit_rate",
    "optimal_block_hit_rate",
    "offline_block_hit_rate",
    "ratio_to_optimal",
    "ratio_to_offline",
}


def run_json(argv: list[str], capsys) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_device_only_planning_rows_equal_the_plain_report(capsys):
    base = ["--workload", f"trace:{TOKEN_FIXTURE}", "--capacity-blocks", "5%,100"]
    plain = run_json([*base, "--policy", "lru,arc"], capsys)
    planned = run_json([*base, "--policy", "lru,arc", "--tiers", "device"], capsys)
    assert [r["policy"] for r in planned["results"]] == ["lru", "arc", "lru", "arc"]
    for old, new in zip(plain["results"], planned["results"], strict=True):
        assert {k: new[k] for k in PLAIN_FIELDS} == old
        assert new["tier_block_hit_rate"] == {"device": old["block_hit_rate"]}
    assert {k: v for k, v in planned.items() if k != "results"} == {
        k: v for k, v in plain.items() if k != "results"
    }


def test_planning_json_has_the_documented_fields_and_files(tmp_path, capsys):
    # devices of at least twice the longest prompt (51 blocks) store every block they see
    argv = ["--workload", f"trace:{TOKEN_FIXTURE}", "--capacity-blocks", "110,150"]
    argv += ["--tiers", "memory:10%,redis:100%", "--replicas", "1,2", "--route", "session,kv"]
    argv += ["--prefill-ms-per-token", "0.5", "--load-ms-per-block", "device=0,memory=1,redis=3"]
    argv += ["--decode-ms-per-token", "0.25", "--decode-weight", "0.3"]
    report = run_json([*argv, "--out", str(tmp_path)], capsys)
    rows = report["results"]
    assert [(r["tier_capacity_blocks"]["device"], r["replicas"], r["route"]) for r in rows] == [
        (110, 1, "session"),
        (110, 2, "session"),
        (110, 2, "kv"),
        (150, 1, "session"),
        (150, 2, "session"),
        (150, 2, "kv"),
    ]
    assert report["cost_model"] == {
        "prefill_ms_per_token": 0.5,
        "load_ms_per_block": {"device": 0.0, "memory": 1.0, "redis": 3.0},
    }
    tokens = 156 * 186.1  # requests x mean input tokens (README of the fixtures)
    for r in rows:
        assert set(r) == PLAIN_FIELDS | PLAN_FIELDS | {"est_ttft_s", "est_ttft_nocache_s"}
        caps = r["tier_capacity_blocks"]
        assert caps == {"device": caps["device"], "memory": 69, "redis": 687}
        assert r["capacity_blocks"] == r["replicas"] * (caps["device"] + 69) + 687
        assert r["write_policy"] == {"memory": "write-back", "redis": "write-through"}
        assert sum(r["tier_block_hits"].values()) == 1731 - 687  # redis holds everything
        assert r["block_hit_rate"] == report["infinite_block_hit_rate"]
        assert r["block_hit_rate"] == pytest.approx(sum(r["tier_block_hit_rate"].values()))
        assert sum(r["requests_per_replica"]) == 156
        busiest = max(r["requests_per_replica"]) / (156 / r["replicas"])
        assert r["routed_max_to_mean"] == pytest.approx(busiest, abs=1e-4)
        assert r["service_model"] == {"prefill_ms_per_token": 0.5, "decode_ms_per_token": 0.25}
        kv = {"prefill_weight": 1.0, "decode_weight": 0.3, "key_load_slack": 4096.0}
        kv |= {"host_block_cost": 0.05, "disk_block_cost": 0.2, "redis_block_cost": 0.5}
        kv |= {"device_affinity": 1.0}
        assert r["routing"] == (kv if r["route"] == "kv" else None)
        assert r["est_queue_wait_s"] >= 0
        assert r["est_ttft_nocache_s"] == pytest.approx(0.5 * tokens / 156 / 1000, abs=1e-4)
        assert r["est_ttft_s"] < r["est_ttft_nocache_s"]
    assert json.loads((tmp_path / "hitrate.json").read_text()) == report
    table = (tmp_path / "hitrate.md").read_text()
    assert table.count("| device 110, memory 69, redis 687 |") == 3
    assert "| est TTFT s | no cache s | requests per replica | max/mean |" in table
    assert table.count("| 156 | 1.00 |") == 2  # the one-replica rows
    assert (tmp_path / "hitrate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_planning_prints_a_table_with_a_column_per_tier(capsys):
    argv = ["--workload", f"trace:{TOKEN_FIXTURE}", "--tiers", "device:30,lmdb:50"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "lmdb" in out
    assert "conversation_tokens: 156 requests" in out
    assert "max/mean" not in out  # one replica: no routing columns


TRACE = ["--workload", f"trace:{TOKEN_FIXTURE}"]
PREFILL = ["--prefill-ms-per-token", "1"]
KV_NEGATIVE = ["--decode-weight=-1"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*TRACE], "required: --capacity-blocks"),
        ([*TRACE, "--tiers", "memory:10"], "has no device:C"),
        ([*TRACE, "--capacity-blocks", "5", "--tiers", "device:5"], "would be unused"),
        ([*TRACE, "--tiers", "device:5,disk:9"], "unknown tier 'disk'"),
        ([*TRACE, "--tiers", "device:5,memory"], "needs a capacity"),
        ([*TRACE, "--tiers", "device:5,redis:9,memory:9"], "fastest first"),
        ([*TRACE, "--tiers", "device:5,memory:lots"], "neither a block count"),
        ([*TRACE, "--tiers", "device:5", "--replicas", "0"], "integers >= 1"),
        ([*TRACE, "--tiers", "device:5", "--route", "random"], "unknown route 'random'"),
        (
            [*TRACE, "--tiers", "device:5", "--replicas", "2", "--route", "session,prefix"],
            "--route: route 'prefix' was replaced by 'kv'",
        ),
        (
            [*TRACE, "--tiers", "device:5", "--replicas", "2", "--prefill-weight", "2"],
            "--prefill-weight weighs the kv route: add --route kv",
        ),
        (
            [*TRACE, "--tiers", "device:5", "--route", "kv", "--decode-weight", "1"],
            "--decode-weight weighs the kv route",  # one replica: no route runs
        ),
        (
            [*TRACE, "--tiers", "device:5", "--replicas", "2", "--route", "kv", *KV_NEGATIVE],
            "--decode-weight must be a finite number >= 0",
        ),
        (
            [*TRACE, "--tiers", "device:5", "--decode-ms-per-token=-1"],
            "--decode-ms-per-token must be a finite number >= 0",
        ),
        ([*TRACE, "--tiers", "device:5,memory:9", "--write-policy", "memory=maybe"], "choose"),
        ([*TRACE, "--tiers", "device:5", "--write-policy", "redis=off"], "no --tiers"),
        ([*TRACE, "--tiers", "device:5", "--write-policy", "device=off"], "no write policy"),
        ([*TRACE, "--tiers", "device:5", "--policy", "mru"], "'mru'"),
        ([*TRACE, "--tiers", "device:5", "--load-ms-per-block", "device=0"], "needs --prefill"),
        ([*TRACE, "--tiers", "device:5", *PREFILL], "needs --load-ms"),
        (
            [*TRACE, "--tiers", "device:5,memory:9", *PREFILL, "--load-ms-per-block", "device=0"],
            "add memory=MS",
        ),
        (
            [
                *TRACE,
                "--tiers",
                "device:5",
                "--prefill-ms-per-token=-1",
                "--load-ms-per-block=device=0",
            ],
            "finite number >= 0",
        ),
        (
            [*TRACE, "--tiers", "device:5", *PREFILL, "--load-ms-per-block", "device=fast"],
            "must be numbers",
        ),
    ],
)
def test_bad_planning_flags_exit_2_with_a_one_line_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]
    assert err[-1].startswith("python -m bench hitrate: error:")
