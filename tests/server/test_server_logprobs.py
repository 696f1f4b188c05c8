"""The official `openai` client against `kvstore serve --model tiny`: logprobs of generated
tokens (chat, streamed or not) and completions' echo with the prompt's logprobs (max_tokens
0 and 1), whose repeat hits the cache and gives the same logprobs; bad logprobs fields are
400s naming them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import ServerProcess, clean_env, free_port, kvstore_script

pytestmark = pytest.mark.integration
NO_EOS = {"ignore_eos": True}
TOL = 2e-4  # a logprob is a logit less a log-sum-exp: twice the fp32 contract's 1e-4
PROMPT = "Logprobs of this prompt, echoed back in full."  # 45 bytes + BOS: 46 tokens
CHAT = [{"role": "user", "content": "Answer with logprobs, please."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    base: Path = tmp_path_factory.mktemp("logprobs-server")
    port = free_port()
    args = [kvstore_script(), "serve", "--model", "tiny", "--port", str(port), "--device",
            "cpu", "--device-blocks", "256", "--log-level", "warning"]  # fmt: skip
    process = ServerProcess(args, port, base / "server.log", clean_env()).start()
    try:
        yield process.wait_ready()
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def chat(client: openai.OpenAI, **kwargs: object):
    return client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2, extra_body=NO_EOS, **kwargs,
    )  # fmt: skip


def test_chat_logprobs_hold_each_generated_token_and_its_top_two(client) -> None:
    answer = chat(client)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 5
    assert [len(entry.top_logprobs) for entry in content] == [2] * 5
    for entry in content:  # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[1].logprob <= entry.logprob


def test_streamed_chat_carries_each_tokens_logprobs_in_its_delta(client) -> None:
    plain = chat(client).choices[0].logprobs.content
    chunks = [c for c in chat(client, stream=True) if c.choices]
    with_text = [c for c in chunks if c.choices[0].delta.content]
    assert all(c.choices[0].logprobs is not None for c in with_text)
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(streamed) == 5
    for got, want in zip(streamed, plain, strict=True):
        assert got.token == want.token
        assert abs(got.logprob - want.logprob) <= TOL
        assert len(got.top_logprobs) == 2


def echo(client: openai.OpenAI, max_tokens: int):
    return client.completions.create(
        model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=max_tokens,
        temperature=0, extra_body=NO_EOS,
    )  # fmt: skip


def test_echo_returns_the_prompts_logprobs_and_its_repeat_hits_the_cache(client) -> None:
    only, one = echo(client, max_tokens=0), echo(client, max_tokens=1)
    first, second = only.choices[0], one.choices[0]
    assert (first.text, first.finish_reason, only.usage.completion_tokens) == (PROMPT, "length", 0)
    assert second.text.startswith(PROMPT) and len(second.text) > len(PROMPT)
    assert (len(first.logprobs.tokens), len(second.logprobs.tokens)) == (46, 47)
    assert first.logprobs.token_logprobs[0] is None and first.logprobs.top_logprobs[0] is None
    assert "".join(first.logprobs.tokens[1:]) == PROMPT  # after the BOS
    assert all(len(top) in (1, 2) for top in first.logprobs.top_logprobs[1:])
    # the first computed every position; the second's two whole blocks came from the cache
    assert only.usage.prompt_tokens_details.cached_tokens == 0
    assert one.usage.prompt_tokens_details.cached_tokens == 32
    again = second.logprobs.token_logprobs[1:46]
    assert all(
        abs(a - b) <= TOL for a, b in zip(first.logprobs.token_logprobs[1:], again, strict=True)
    )


def test_a_streamed_echo_sends_the_prompt_first(client) -> None:
    kwargs = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 1, "temperature": 0}
    for max_tokens, num_tokens in ((2, 46 + 2), (0, 46)):
        chunks = list(
            client.completions.create(
                **kwargs, max_tokens=max_tokens, stream=True, extra_body=NO_EOS
            )
        )
        assert chunks[0].choices[0].text.startswith(PROMPT)
        tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert len(tokens) == num_tokens


def test_vllms_prompt_logprobs_field_has_each_prompt_tokens(server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 3, "temperature": 0}
    choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == 46 and entries[0] is None
    assert all(str(ord(c)) in entry for c, entry in zip(PROMPT, entries[1:], strict=True))
    assert all(len(entry) in (3, 4) for entry in entries[1:])  # the token and the top 3
    assert choice["logprobs"] is None  # not asked for the generated tokens


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "chat/completions",
            {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("completions", {"prompt": "hi", "logprobs": 6}, "logprobs"),
        ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
def test_bad_logprobs_fields_are_400_naming_the_field(server, path, body, param) -> None:
    response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


# --- several choices (n, best_of): each choice carries its own logprobs ------------------

HOT = {"temperature": 1.0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


def hot_chat(client: openai.OpenAI, **kwargs: object):
    return client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=2, **HOT,
        **kwargs,
    )  # fmt: skip


def same_entries(got: list, want: list) -> bool:
    """Chat logprobs entries: the same tokens and alternatives, logprobs within TOL."""
    return [(e.token, [t.token for t in e.top_logprobs]) for e in got] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in want
    ] and all(abs(a.logprob - b.logprob) <= TOL for a, b in zip(got, want, strict=True))


def test_each_of_n_chat_choices_has_the_logprobs_of_its_seeded_request(client) -> None:
    group = hot_chat(client, n=2, seed=7)
    assert [c.index for c in group.choices] == [0, 1]
    for i, choice in enumerate(group.choices):
        alone = hot_chat(client, seed=7 + i).choices[0]
        ids = choice.model_extra["token_ids"]
        assert ids == alone.model_extra["token_ids"] and len(ids) == 5
        assert len(choice.logprobs.content) == 5
        assert [len(e.top_logprobs) for e in choice.logprobs.content] == [2] * 5
        assert same_entries(choice.logprobs.content, alone.logprobs.content)
    assert group.choices[0].message.content != group.choices[1].message.content


def test_a_streamed_n_2_chat_carries_each_choices_logprobs_with_its_index(client) -> None:
    whole = hot_chat(client, n=2, seed=8)
    streamed: dict[int, list] = {0: [], 1: []}
    for chunk in hot_chat(client, n=2, seed=8, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed[choice.index] += choice.logprobs.content
    for choice in whole.choices:
        assert len(streamed[choice.index]) == 5
        assert same_entries(streamed[choice.index], choice.logprobs.content)


def echo_choices(client: openai.OpenAI, max_tokens: int, **kwargs: object):
    return client.completions.create(
        model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=max_tokens, n=2,
        seed=3, **HOT, **kwargs,
    )  # fmt: skip


def test_echoed_n_2_completions_each_start_with_the_prompt_and_its_logprobs(client) -> None:
    prompt = echo(client, max_tokens=0).choices[0].logprobs  # n=1's: 46 tokens
    one, only = echo_choices(client, max_tokens=1), echo_choices(client, max_tokens=0)
    for choice in one.choices:
        logprobs = choice.logprobs
        assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
        assert len(logprobs.tokens) == 46 + 1 and logprobs.tokens[:46] == prompt.tokens
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        pairs = zip(logprobs.token_logprobs[1:46], prompt.token_logprobs[1:], strict=True)
        assert all(abs(a - b) <= TOL for a, b in pairs)
        assert logprobs.text_offset[:46] == prompt.text_offset  # each choice's own offsets
    assert [c.text for c in only.choices] == [PROMPT, PROMPT]
    assert [len(c.logprobs.tokens) for c in only.choices] == [46, 46]
    assert [c.finish_reason for c in only.choices] == ["length", "length"]
    assert (only.usage.prompt_tokens, only.usage.completion_tokens) == (46, 0)


def test_a_streamed_echo_of_n_2_sends_each_choice_the_prompt_first(client) -> None:
    for max_tokens, num_tokens in ((2, 46 + 2), (0, 46)):
        text: dict[int, str] = {0: "", 1: ""}
        tokens: dict[int, list] = {0: [], 1: []}
        for chunk in echo_choices(client, max_tokens=max_tokens, stream=True):
            (choice,) = chunk.choices
            if not text[choice.index]:
                assert choice.text.startswith(PROMPT)
            text[choice.index] += choice.text
            tokens[choice.index] += choice.logprobs.tokens if choice.logprobs else []
        assert [len(tokens[i]) for i in (0, 1)] == [num_tokens, num_tokens]
        assert [tokens[i][:46] for i in (0, 1)] == [tokens[0][:46]] * 2


def test_best_of_answers_its_best_sequence_with_that_sequences_logprobs(client) -> None:
    kwargs = {"model": "tiny", "prompt": PROMPT, "logprobs": 2, "max_tokens": 4, "seed": 5}
    every = client.completions.create(n=3, **kwargs, **HOT).choices  # best_of's 3 sequences
    (ranked,) = client.completions.create(n=1, best_of=3, **kwargs, **HOT).choices
    sums = [sum(c.logprobs.token_logprobs) for c in every]
    best = max(range(3), key=sums.__getitem__)
    assert ranked.text == every[best].text and ranked.index == 0
    assert len(ranked.logprobs.tokens) == 4
    assert abs(sum(ranked.logprobs.token_logprobs) - sums[best]) <= 4 * TOL


def test_vllms_prompt_logprobs_of_n_2_are_each_choices_as_for_one(server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 3, "temperature": 1.0}
    url = f"{server.url}/v1/completions"
    (alone,) = httpx.post(url, json=body, timeout=60).json()["choices"]
    choices = httpx.post(url, json={**body, "n": 2}, timeout=60).json()["choices"]
    assert [len(c["prompt_logprobs"]) for c in choices] == [46, 46]
    for choice in choices:
        assert choice["prompt_logprobs"][0] is None
        for got, want in zip(choice["prompt_logprobs"][1:], alone["prompt_logprobs"][1:],
                             strict=True):  # fmt: skip
            assert got.keys() == want.keys()
            assert all(abs(got[k]["logprob"] - want[k]["logprob"]) <= TOL for k in got)
