import itertools

import numpy as np
import pytest

from bench.workloads import (
    WORKLOADS,
    ConversationConfig,
    MultiTurnConfig,
    RagConfig,
    SharedPrefixConfig,
    WorkloadError,
    make_workload,
    zipf_weights,
)

SMALL = {
    "shared-prefix": SharedPrefixConfig(
        num_groups=5, prompts_per_group=4, system_prompt_len=32, question_len=8
    ),
    "multiturn": MultiTurnConfig(
        num_clients=4, num_turns=3, turn_tokens=8, answer_tokens=4, system_prompt_len=16
    ),
    "rag": RagConfig(
        num_requests=20,
        num_docs=10,
        docs_per_prompt=3,
        doc_len=8,
        question_len=4,
        system_prompt_len=4,
    ),
    "conversation": ConversationConfig(
        num_sessions=20, first_turn_median=50.0, turn_median=10.0, answer_median=10.0
    ),
}


def starts_with(a: np.ndarray, prefix: np.ndarray) -> bool:
    return len(a) >= len(prefix) and bool(np.array_equal(a[: len(prefix)], prefix))


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_same_config_gives_the_same_requests_and_another_seed_does_not(name):
    config = SMALL[name]
    a, b = config.generate(), config.generate()
    assert [(r.timestamp_ms, r.token_ids.tolist()) for r in a] == [
        (r.timestamp_ms, r.token_ids.tolist()) for r in b
    ]
    other = type(config)(**{**config.__dict__, "seed": 1}).generate()
    assert [r.token_ids.tolist() for r in other] != [r.token_ids.tolist() for r in a]
    times = [r.timestamp_ms for r in a]
    assert times == sorted(times)


def test_shared_prefix_defaults_are_sglangs():
    config = SharedPrefixConfig()
    assert (config.num_groups, config.prompts_per_group) == (64, 16)
    assert (config.system_prompt_len, config.question_len) == (2048, 128)


def test_shared_prefix_without_skew_gives_every_group_the_same_number_of_prompts():
    config = SharedPrefixConfig(
        num_groups=5, prompts_per_group=4, system_prompt_len=32, question_len=8, zipf_s=0
    )
    reqs = config.generate()
    heads = [tuple(r.token_ids[:32].tolist()) for r in reqs]
    assert len(reqs) == 20
    assert sorted(heads.count(h) for h in set(heads)) == [4] * 5
    assert all(len(r.token_ids) == 40 for r in reqs)


def test_shared_prefix_with_zipf_skew_favors_the_first_groups():
    config = SharedPrefixConfig(
        num_groups=8, prompts_per_group=50, system_prompt_len=4, question_len=2, zipf_s=1.2
    )
    heads = [tuple(r.token_ids[:4].tolist()) for r in config.generate()]
    counts = sorted((heads.count(h) for h in set(heads)), reverse=True)
    assert counts == [158, 72, 44, 32, 29, 23, 22, 20]  # Zipf(1.2) expects 400 * w


def test_multiturn_turns_extend_the_same_clients_previous_prompt():
    config = SMALL["multiturn"]
    reqs = config.generate()
    assert len(reqs) == 12
    by_len = sorted(reqs, key=lambda r: len(r.token_ids))
    firsts = [r for r in by_len if len(r.token_ids) == 16 + 8]
    assert len(firsts) == 4
    for first in firsts:
        chain = [r for r in reqs if starts_with(r.token_ids, first.token_ids)]
        assert [len(r.token_ids) for r in chain] == [24, 36, 48]  # + answer 4 + turn 8
        assert all(starts_with(b.token_ids, a.token_ids) for a, b in itertools.pairwise(chain))


def test_rag_prompts_hold_distinct_documents_from_the_pool():
    reqs = SMALL["rag"].generate()
    assert all(len(r.token_ids) == 4 + 3 * 8 + 4 for r in reqs)
    for r in reqs:
        docs = {tuple(r.token_ids[4 + 8 * i : 12 + 8 * i].tolist()) for i in range(3)}
        assert len(docs) == 3


def test_conversation_mixes_one_off_prompts_and_sessions_that_extend_their_history():
    reqs = ConversationConfig(
        num_sessions=60, first_turn_median=50.0, turn_median=10.0, answer_median=10.0, seed=4
    ).generate()
    extends = sum(
        any(starts_with(b.token_ids, a.token_ids) for a in reqs[:i]) for i, b in enumerate(reqs)
    )
    assert len(reqs) == 122
    assert extends == 62  # 60 sessions start fresh; every later turn extends its history


def test_zipf_weights_sum_to_one_and_fall_with_rank():
    w = zipf_weights(4, 1.0)
    assert w.sum() == pytest.approx(1.0)
    assert w.tolist() == pytest.approx([12 / 25, 6 / 25, 4 / 25, 3 / 25])
    assert zipf_weights(3, 0).tolist() == pytest.approx([1 / 3] * 3)


def test_make_workload_converts_overrides_to_the_field_types():
    config = make_workload("rag", {"num_docs": "50", "zipf_s": "0.5", "sorted_docs": "true"})
    assert (config.num_docs, config.zipf_s, config.sorted_docs) == (50, 0.5, True)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("rag", {"nope": "1"}, "rag has no parameter 'nope'"),
        ("rag", {"num_docs": "many"}, "num_docs expects a int"),
        ("rag", {"docs_per_prompt": "20", "num_docs": "10"}, "must be <= num_docs"),
        ("multiturn", {"num_turns": "0"}, "num_turns must be a positive number"),
        ("conversation", {"one_off_fraction": "2"}, "one_off_fraction must be in"),
        ("chat", {}, "unknown workload 'chat'"),
    ],
)
def test_invalid_parameters_raise_naming_the_parameter(name, params, message):
    with pytest.raises(WorkloadError, match=message):
        make_workload(name, params)
