"""Several choices per request through the official `openai` client: `n` on chat and
completions (streamed or not), `best_of` ranked by cumulative log-probability, and the
400s of bad or impossible `n` and `best_of`."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from engine_helpers import micro_config
from server_helpers import SERVED_NAME, ServerProcess, clean_env, free_port, kvstore_script

from engine.model.loading import random_model

pytestmark = pytest.mark.integration
NO_EOS = {"ignore_eos": True, "return_token_ids": True}
POOL_BLOCKS = 64  # 63 usable: the engine keeps one scratch block
MAX_N = 8


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    """A server for groups: 8 sequences may run at once, n and best_of up to 8, a small
    pool (so that a group can be too large for it)."""
    log = tmp_path_factory.mktemp("choices") / "server.log"
    args = [kvstore_script(), "serve", "--model", str(model_dir), "--served-model-name",
            SERVED_NAME, "--port", str(port := free_port()), "--block-size", "4",
            "--device-blocks", str(POOL_BLOCKS), "--device", "cpu", "--max-num-seqs", "8",
            "--max-n", str(MAX_N), "--log-level", "warning"]  # fmt: skip
    process = ServerProcess(args, port, log, clean_env(OMP_NUM_THREADS="1")).start()
    try:
        yield process.wait_ready()
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model=SERVED_NAME, messages=messages, **kwargs)


def test_chat_with_n_3_answers_3_choices_each_its_own_seeded_request(client):
    messages = [{"role": "user", "content": "Three answers, please, each its own."}]
    hot = {"max_tokens": 6, "temperature": 1.0, "extra_body": NO_EOS}
    group = chat(client, messages, n=3, seed=40, **hot)
    alone = [chat(client, messages, seed=40 + i, **hot) for i in range(3)]
    assert [c.index for c in group.choices] == [0, 1, 2]
    assert [c.message.content for c in group.choices] == [a.choices[0].message.content
                                                          for a in alone]  # fmt: skip
    assert len({c.message.content for c in group.choices}) == 3  # seeds 40, 41, 42
    assert [c.finish_reason for c in group.choices] == ["length"] * 3
    usage = group.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (alone[0].usage.prompt_tokens, 18)
    assert usage.total_tokens == usage.prompt_tokens + 18


def test_a_streamed_n_2_completion_interleaves_both_indices_and_ends_each(client):
    kwargs = {"model": SERVED_NAME, "prompt": "Stream two completions of this prompt.",
              "max_tokens": 7, "temperature": 1.0, "seed": 3, "n": 2}  # fmt: skip
    whole = client.completions.create(**kwargs, extra_body=NO_EOS)
    chunks = list(
        client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS
        )
    )
    text, finish = defaultdict(str), {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        text[choice.index] += choice.text
        if choice.finish_reason is not None:
            finish[choice.index] = choice.finish_reason
    assert dict(text) == {c.index: c.text for c in whole.choices}
    assert finish == {0: "length", 1: "length"}
    assert len({chunk.id for chunk in chunks}) == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 14)


def cumulative_logprob(model, prompt_ids: list[int], output: list[int]) -> float:
    """The reference: log_softmax of a full forward's logits at each output token, summed."""
    ids = prompt_ids + output
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    n = len(prompt_ids)
    return float(sum(logprobs[n - 1 + k, t] for k, t in enumerate(output)))


def test_best_of_answers_the_sequences_of_highest_cumulative_logprob(client):
    prompt = [256, *b"Rank four sampled sequences by their log-probability."]
    kwargs = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 5, "temperature": 1.0,
              "seed": 11, "extra_body": NO_EOS}  # fmt: skip
    every = client.completions.create(n=4, **kwargs).choices  # the 4 sequences best_of samples
    ranked = client.completions.create(n=2, best_of=4, **kwargs)
    config = micro_config()
    config.max_position_embeddings = 8192  # as the server's model directory
    model = random_model(config, seed=1)
    scores = [cumulative_logprob(model, prompt, c.model_extra["token_ids"]) for c in every]
    order = sorted(range(4), key=lambda i: -scores[i])
    assert [c.index for c in ranked.choices] == [0, 1]
    assert [c.text for c in ranked.choices] == [every[i].text for i in order[:2]]
    assert ranked.usage.completion_tokens == 10  # the answered choices' tokens


def error_of(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"n": MAX_N + 1}, "n", f"n is {MAX_N + 1}; this server allows at most {MAX_N}"),
        ({"n": "2"}, "n", "valid integer"),
        ({"best_of": 0}, "best_of", "greater than or equal to 1"),
        ({"n": 3, "best_of": 2}, "best_of", "best_of (2) must be >= n (3)"),
        ({"best_of": MAX_N + 1}, "best_of", f"at most {MAX_N}"),
        ({"best_of": 3, "stream": True}, "best_of", "best_of > n cannot stream"),
    ],
)
def test_bad_n_and_best_of_are_400_naming_the_field(server, body, param, message):
    request = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2, **body}
    error = error_of(httpx.post(f"{server.url}/v1/completions", json=request, timeout=30))
    assert error["param"] == param
    assert message in error["message"]


def test_a_group_the_pool_can_never_hold_is_refused_up_front(server):
    # 239 prompt tokens + BOS: 61 blocks for the prompt and a decode slot, 1 more per other
    # sequence; the pool's 63 usable blocks hold n=3 (63), never n=4 (64)
    prompt = "x" * 239
    for field, extra in (("n", {"n": 4}), ("best_of", {"best_of": 4})):
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, **extra}
        error = error_of(httpx.post(f"{server.url}/v1/completions", json=body, timeout=30))
        assert error["param"] == field
        assert error["message"].startswith(f"{field} is 4: 4 sequences of a 240-token prompt")
        assert "need 64 blocks" in error["message"] and "holds 63" in error["message"]
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "n": 3}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 3
    assert server.healthy()


def test_logprobs_of_several_choices_one_at_a_time_are_refused_naming_the_field(
    model_dir, tmp_path
):
    # a pool too small for the batched engine's self-test: the per-request fallback, which
    # computes no logprobs (a 400 naming the field, as for n=1), runs n sequences one by one
    args = [kvstore_script(), "serve", "--model", str(model_dir), "--served-model-name",
            SERVED_NAME, "--port", str(port := free_port()), "--block-size", "4",
            "--device-blocks", "6", "--device", "cpu", "--log-level", "warning"]  # fmt: skip
    env = clean_env(OMP_NUM_THREADS="1")
    process = ServerProcess(args, port, tmp_path / "server.log", env).start()
    try:
        url = f"{process.wait_ready().url}/v1/completions"
        body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2, "n": 2}
        for field in ("logprobs", "prompt_logprobs"):
            error = error_of(httpx.post(url, json={**body, field: 1}, timeout=30))
            assert error["param"] == field
            assert "served one request at a time" in error["message"]
        answer = httpx.post(url, json=body, timeout=60)
        assert answer.status_code == 200 and len(answer.json()["choices"]) == 2
    finally:
        process.stop()
