import json
from pathlib import Path

import numpy as np
import pytest

from bench.fixtures.make_fixtures import MOONCAKE, TOKENS
from bench.traces import (
    Request,
    TraceError,
    from_chains,
    from_token_requests,
    load_trace,
    mooncake_records,
    read_mooncake,
    write_mooncake,
    write_token_jsonl,
)

FIXTURES = Path(__file__).resolve().parents[2] / "bench" / "fixtures"


def write_lines(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_mooncake_requests_keep_the_full_blocks_of_their_first_l_minus_1_tokens(tmp_path):
    path = write_lines(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]},
            {"timestamp": 40, "input_length": 1024, "output_length": 5, "hash_ids": [7, 8]},
            {"timestamp": 90, "input_length": 1025, "output_length": 5, "hash_ids": [7, 8, 3]},
            {"timestamp": 95, "input_length": 300, "output_length": 5, "hash_ids": [4]},
        ],
    )
    trace = read_mooncake(path)
    # 1100 and 1025 tokens: 2 full blocks; 1024: only 1 (its last token is always computed)
    assert [trace.request(r).tolist() for r in range(4)] == [[0, 1], [0], [0, 1], []]
    assert trace.num_tokens.tolist() == [1100, 1024, 1025, 300]
    assert trace.timestamps.tolist() == [0.0, 40.0, 90.0, 95.0]
    assert trace.block_tokens == 512
    assert trace.parents().tolist() == [-1, 0]
    assert trace.stats().infinite_block_hit_rate == 3 / 5


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"timestamp": 0, "input_length": 2000, "hash_ids": [1, 2]}, "needs at least 3 hash_ids"),
        ({"timestamp": 0, "hash_ids": [1]}, "missing field 'input_length'"),
        ({"timestamp": 0, "input_length": 600, "hash_ids": [-1, 2]}, "non-negative integer"),
        ({"timestamp": 0, "input_length": -3, "hash_ids": []}, "non-negative integer"),
    ],
)
def test_malformed_mooncake_records_name_the_line_and_the_fix(tmp_path, record, message):
    path = write_lines(tmp_path / "bad.jsonl", [record])
    with pytest.raises(TraceError, match=message) as exc:
        read_mooncake(path)
    assert "bad.jsonl:1" in str(exc.value)


def test_a_hash_id_under_two_different_parents_is_rejected(tmp_path):
    records = [
        {"timestamp": 0, "input_length": 1100, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 1100, "hash_ids": [5, 2, 3]},
    ]
    with pytest.raises(TraceError, match="line 2: block id 2 follows a different parent"):
        read_mooncake(write_lines(tmp_path / "t.jsonl", records))


def test_token_requests_sharing_a_prefix_share_block_ids():
    rng = np.random.default_rng(0)
    system, a, b = (rng.integers(0, 1000, n, dtype=np.uint32) for n in (40, 20, 9))
    reqs = [Request(0.0, np.concatenate([system, a])), Request(5.0, np.concatenate([system, b]))]
    trace = from_token_requests(reqs, block_size=16)
    # 60 tokens -> 3 full blocks of the first 59; 49 tokens -> 3 of the first 48
    assert trace.request(0).tolist() == [0, 1, 2]
    assert trace.request(1).tolist() == [0, 1, 3]
    assert trace.num_unique == 4


def test_mooncake_writer_agrees_with_hashing_the_tokens_in_512_token_blocks(tmp_path):
    reqs = TOKENS.__class__(num_sessions=30, first_turn_median=1500.0, seed=3).generate()
    write_mooncake(tmp_path / "m.jsonl", reqs)
    from_file = read_mooncake(tmp_path / "m.jsonl")
    direct = from_token_requests(reqs, block_size=512)
    assert from_file.blocks.tolist() == direct.blocks.tolist()
    assert from_file.offsets.tolist() == direct.offsets.tolist()
    records = mooncake_records(reqs)
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in records)


def test_token_jsonl_round_trips(tmp_path):
    reqs = TOKENS.generate()[:20]
    write_token_jsonl(tmp_path / "t.jsonl", reqs)
    trace = load_trace(tmp_path / "t.jsonl", block_size=8)
    direct = from_token_requests(reqs, block_size=8)
    assert trace.blocks.tolist() == direct.blocks.tolist()
    assert trace.timestamps.tolist() == pytest.approx([r.timestamp_ms for r in reqs], abs=1e-3)


def test_load_trace_tells_the_formats_apart_and_rejects_others(tmp_path):
    assert load_trace(FIXTURES / "conversation_mooncake.jsonl").block_tokens == 512
    assert load_trace(FIXTURES / "conversation_tokens.jsonl", block_size=16).block_tokens == 16
    with pytest.raises(TraceError, match="neither 'hash_ids' nor 'token_ids'"):
        load_trace(write_lines(tmp_path / "x.jsonl", [{"timestamp": 0}]))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="empty"):
        load_trace(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:1: not JSON"):
        load_trace(tmp_path / "bad.jsonl")


def test_fixtures_have_the_documented_statistics():
    moon = load_trace(FIXTURES / "conversation_mooncake.jsonl").stats()
    assert (moon.requests, moon.block_refs, moon.unique_blocks) == (1984, 34856, 18397)
    assert round(moon.mean_input_tokens, 1) == 9248.6
    tok = load_trace(FIXTURES / "conversation_tokens.jsonl", block_size=16).stats()
    assert (tok.requests, tok.block_refs, tok.unique_blocks) == (156, 1731, 687)
    readme = (FIXTURES / "README.md").read_text()
    assert "| 1,984 | 34,856 | 18,397 | 9,248.6 | 47.2% |" in readme
    assert "| 156 | 1,731 | 687 | 186.1 | 60.3% |" in readme


def test_fixtures_are_what_the_seeded_generator_makes():
    lines = (FIXTURES / "conversation_mooncake.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == mooncake_records(MOONCAKE.generate())
    tokens = (FIXTURES / "conversation_tokens.jsonl").read_text().splitlines()
    first = json.loads(tokens[0])
    assert first["token_ids"] == TOKENS.generate()[0].token_ids.tolist()


def test_chains_with_negative_ids_are_rejected():
    with pytest.raises(TraceError, match=">= 0"):
        from_chains([[0, -1]])
