"""Server parts without HTTP: salts, the wait queue's order and bound, streaming text, request
validation, the server's metrics."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
from engine_helpers import micro_cache_config, micro_model

from engine.api import openai as protocol
from engine.api.auth import Authenticator, AuthError, CacheSaltError, request_salt, tenant_salt
from engine.api.errors import ApiError
from engine.api.keys import load_api_keys
from engine.loop.engine import Engine
from engine.loop.request import (
    GenerateResult,
    QueueFullError,
    Request,
    RequestCancelled,
    SamplingParams,
)
from engine.model.loading import byte_tokenizer
from engine.server.config import ServerConfig
from engine.server.metrics import ServerMetrics
from engine.server.streaming import TextStreamer
from kvstore.config import ConfigError

SECRET = b"deployment-secret"


# --- tenants and salts ----------------------------------------------------------------------


def test_tenant_salts_differ_by_tenant_and_secret_and_are_stable():
    salt = tenant_salt("x", SECRET)
    assert salt == tenant_salt("x", SECRET)
    assert len(salt) == 32 and int(salt, 16) >= 0
    assert len({salt, tenant_salt("y", SECRET), tenant_salt("x", b"other-secret")}) == 3


def test_a_request_salt_narrows_its_tenant_salt_and_is_validated():
    base = tenant_salt("x", SECRET)
    assert request_salt(base, None) == request_salt(base, "") == base
    narrowed = {request_salt(base, "a"), request_salt(base, "b"), request_salt("", "a")}
    assert len(narrowed | {base}) == 4
    for bad in ("s" * 257, "tab\there", 7):
        with pytest.raises(CacheSaltError, match="cache_salt"):
            request_salt(base, bad)


def test_keys_map_to_tenants_and_missing_or_wrong_keys_are_refused():
    auth = Authenticator({"k1": "x", "k2": "x", "k3": "y"}, SECRET)
    assert [auth.tenant("Bearer k1"), auth.tenant("bearer k2"), auth.tenant("Bearer k3")] == [
        "x", "x", "y"]  # fmt: skip
    assert auth.salt("x") == tenant_salt("x", SECRET) != auth.salt("y")
    for header in (None, "", "Bearer", "Basic k1", "Bearer nope"):
        with pytest.raises(AuthError):
            auth.tenant(header)
    open_auth = Authenticator({}, SECRET)
    assert (open_auth.tenant(None), open_auth.salt(None)) == (None, "")


def test_api_keys_file_is_a_json_object_of_key_to_tenant(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-1": "acme", "sk-2": "acme"}))
    assert load_api_keys(path) == {"sk-1": "acme", "sk-2": "acme"}
    for bad in ('["sk-1"]', "{}", '{"has space": "t"}', '{"sk": ""}', "not json"):
        path.write_text(bad)
        with pytest.raises(ConfigError, match="api_keys"):
            load_api_keys(path)


def test_server_config_rejects_bad_limits():
    with pytest.raises(ConfigError, match="max_queue"):
        ServerConfig(max_queue=0)
    with pytest.raises(ConfigError, match="metrics_require_key"):
        ServerConfig(metrics_require_key=True)
    with pytest.raises(ConfigError, match="max_n"):
        ServerConfig(max_n=0)


CLASH_FIX = ("; give --port, --kv-events-port and --kv-events-replay-port a port each "
             "(--kv-events-replay-port defaults to --kv-events-port + 1)")  # fmt: skip


@pytest.mark.parametrize(
    ("ports", "message"),
    [
        ({"port": 8001, "kv_events_port": 8000},  # the default replay port is the HTTP one
         "kv_events_replay_port: --kv-events-replay-port 8001 equals --port 8001" + CLASH_FIX),
        ({"port": 8000, "kv_events_port": 8000, "kv_events_replay_port": 9000},
         "kv_events_port: --kv-events-port 8000 equals --port 8000" + CLASH_FIX),
        ({"kv_events_port": 5557, "kv_events_replay_port": 5557},
         "kv_events_replay_port: --kv-events-replay-port 5557 equals --kv-events-port 5557"
         + CLASH_FIX),
        ({"kv_events_port": 65535}, "kv_events_replay_port: must be <= 65535, got 65536"),
        ({"kv_events_replay_port": 5558}, "kv_events_replay_port: needs --kv-events-port"),
    ],
)  # fmt: skip
def test_event_port_clashes_name_both_flags_and_the_port(ports, message):
    with pytest.raises(ConfigError) as error:
        ServerConfig(**ports)
    assert str(error.value) == message


def test_the_replay_port_flag_round_trips_and_defaults_to_the_events_port_plus_one():
    from engine.cli import build_parser
    from engine.server.config import server_config_from_args

    def config(*flags: str) -> ServerConfig:
        return server_config_from_args(build_parser().parse_args(["serve", *flags]), env={})

    given = config("--kv-events-port", "5557", "--kv-events-replay-port", "6000")
    assert given.ports() == {"port": 8000, "kv_events_port": 5557, "kv_events_replay_port": 6000}
    derived = config("--port", "9000", "--kv-events-port", "5557")
    assert derived.ports() == {"port": 9000, "kv_events_port": 5557, "kv_events_replay_port": 5558}
    assert config().ports() == {"port": 8000}
    assert config().kv_events_replay_port is None


# --- scheduler ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(micro_model(seed=1), micro_cache_config()) as eng:
        yield eng


def one_token() -> SamplingParams:
    return SamplingParams(max_new_tokens=1)


class Gate:
    """A running request that blocks the engine loop (in its token callback) until `open()`."""

    def __init__(self, engine: Engine):
        self.started, self.released = threading.Event(), threading.Event()
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        self.job = engine.add_request(Request([1, 2, 3], params, on_token=self._block))
        assert self.started.wait(30)

    def _block(self, token_id: int) -> None:
        self.started.set()
        assert self.released.wait(30)

    def open(self) -> None:
        self.released.set()


def test_waiting_requests_are_fifo_per_tenant_and_round_robin_across_tenants(engine):
    gate, order = Gate(engine), []
    names = [("x", 1), ("x", 2), ("x", 3), ("y", 1), ("y", 2), ("z", 1)]
    jobs = [
        engine.add_request(
            Request([5, 6, 7], one_token(), tenant=t, on_token=lambda _, n=(t, i): order.append(n)),
            max_waiting=16,
        )
        for t, i in names
    ]
    assert engine.queue_stats().waiting_by_tenant == {"x": 3, "y": 2, "z": 1}
    gate.open()
    for job in jobs:
        assert isinstance(job.future.result(30), GenerateResult)
    assert order == [("x", 1), ("y", 1), ("z", 1), ("x", 2), ("y", 2), ("x", 3)]


def test_a_full_queue_refuses_and_cancel_frees_a_slot(engine):
    gate = Gate(engine)
    first = engine.add_request(Request([5, 6], one_token(), tenant="x"), max_waiting=2)
    engine.add_request(Request([5, 6], one_token(), tenant="y"), max_waiting=2)
    with pytest.raises(QueueFullError):
        engine.add_request(Request([5, 6], one_token(), tenant="z"), max_waiting=2)
    engine.cancel(first)
    assert first.future.cancelled()
    late = engine.add_request(Request([5, 6], one_token(), tenant="z"), max_waiting=2)
    engine.cancel(gate.job)  # running: it stops at its next token
    gate.open()
    with pytest.raises(RequestCancelled):
        gate.job.future.result(30)
    assert late.future.result(30).prompt_tokens == 2
    assert engine.queue_stats() == (0, 0, {}, 0, 0)


def test_at_the_bound_a_flooding_tenant_gives_way_to_a_quiet_one(engine):
    """The newest waiting request of the tenant with the most waiting is refused (429) so a
    tenant with 2 fewer gets in; between near-equals the bound holds."""
    gate = Gate(engine)
    floods = [engine.add_request(Request([5, 6], one_token(), tenant="a"), max_waiting=3)
              for _ in range(3)]  # fmt: skip
    quiet = engine.add_request(Request([5, 6], one_token(), tenant="b"), max_waiting=3)
    with pytest.raises(QueueFullError, match="from its tenant"):
        floods[-1].future.result(5)
    assert engine.queue_stats().waiting_by_tenant == {"a": 2, "b": 1}
    with pytest.raises(QueueFullError, match="the bound"):  # a holds 2, b would hold 2
        engine.add_request(Request([5, 6], one_token(), tenant="b"), max_waiting=3)
    gate.open()
    assert [job.future.result(30).prompt_tokens for job in (*floods[:2], quiet)] == [2, 2, 2]


def test_the_queue_reports_the_tokens_it_must_prefill_beyond_cached_prefixes(engine):
    """What a router weighs: a waiting prompt counts only past the prefix its replica held
    when it was queued; a running request counts the K/V it holds."""
    from engine_helpers import BLOCK_SIZE

    prompt = [(7 * i + 3) % 256 for i in range(4 * BLOCK_SIZE + 2)]
    engine.generate([prompt], SamplingParams(max_new_tokens=1))  # its 4 whole blocks cached
    gate = Gate(engine)
    engine.add_request(Request(prompt, one_token(), tenant="x"))
    engine.add_request(Request([9] * 10, one_token(), tenant="x"))
    stats = engine.queue_stats()
    assert stats.queued_tokens == (len(prompt) - 4 * BLOCK_SIZE) + 10
    assert stats.running_tokens == gate.job.state.num_computed > 0
    gate.open()
    gate.job.future.result(30)


def test_server_metrics_observe_finished_requests(engine):
    metrics = ServerMetrics(engine.stats, engine.queue_stats)
    params = SamplingParams(max_new_tokens=2)
    job = Request(list(range(1, 10)), params, tenant="acme", on_done=metrics.observe)
    result = engine.add_request(job, max_waiting=4).future.result(30)
    engine.close()
    value = metrics.registry.get_sample_value
    assert value("kvstore_requests_total", {"outcome": "ok"}) == 1
    assert value("kvstore_tenant_prompt_tokens_total", {"tenant": "acme"}) == result.prompt_tokens
    assert value("kvstore_time_to_first_token_seconds_count") == 1


# --- streaming, validation --------------------------------------------------------------------


def stream_text(text: str, stop: tuple[str, ...], final: str) -> list[str]:
    tok = byte_tokenizer()
    streamer = TextStreamer(tok, stop)
    deltas = [streamer.push(t) for t in tok(text, add_special_tokens=False)["input_ids"]]
    return [*deltas, streamer.finish(final)]


def test_streamed_text_never_includes_a_stop_string_or_half_a_character():
    assert stream_text("héllo", (), "héllo") == ["h", "", "é", "l", "l", "o", ""]  # é: 2 bytes
    deltas = stream_text("héllo END more", ("END",), "héllo ")
    assert "".join(deltas) == "héllo "
    assert all("E" not in d for d in deltas)


def test_unsupported_fields_are_400_naming_the_parameter():
    cases = [({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": "x", "n": 0}, "n"),
             ({"prompt": "x", "logit_bias": {"1": 2}}, "logit_bias"),
             ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": []}, "prompt"),
             ({"max_tokens": 2}, "prompt")]  # fmt: skip
    for body, param in cases:
        with pytest.raises(ApiError) as info:
            protocol.parse_body(protocol.CompletionRequest, body).single_prompt()
        assert (info.value.status, info.value.param) == (400, param)


# --- the load generator's sessions ------------------------------------------------------------


def test_bench_serve_chains_turns_into_sessions_and_alternates_replicas():
    from bench.serve import Runner, build_parser, build_workload, sessions_of

    requests = build_workload("multiturn", ["num_clients=3", "num_turns=4"], None)
    sessions = sessions_of(requests)
    assert [len(s.turns) for s in sessions] == [4, 4, 4]
    for session in sessions:
        lengths = [len(t.token_ids) for t in session.turns]
        assert lengths == [256 + 64 + k * 96 for k in range(4)]  # history + answer + turn
    args = build_parser().parse_args(["--url", "http://a", "--url", "http://b"])
    runner = Runner(args, "m")
    assert [runner.url_for(1, k) for k in range(4)] == ["http://b", "http://a"] * 2
    args.route = "session"
    assert {runner.url_for(1, k) for k in range(4)} == {"http://b"}
