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
