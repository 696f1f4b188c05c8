"""The official `openai` client against `kvstore serve`: completions and chat, streamed or
not, with usage (cached_tokens included)."""

from __future__ import annotations

import openai
import pytest
from server_helpers import BLOCK_SIZE, SERVED_NAME

from engine.api.errors import ApiError
from engine.model.loading import byte_tokenizer
from engine.server.service import max_new_tokens

pytestmark = pytest.mark.integration
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(keyed_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="sk-x-one", max_retries=0)


def cacheable(prompt_tokens: int) -> int:
    """What a repeat of a prompt hits: whole blocks of all but its last token."""
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def chat_prompt_tokens(messages: list[dict]) -> int:
    tok = byte_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]


def test_completion_reports_usage_and_its_repeat_hits_the_cache(client):
    prompt = "The openai client sends this completion prompt twice."  # 53 bytes + BOS
    kwargs = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 5, "temperature": 0}
    first = client.completions.create(**kwargs, extra_body=NO_EOS)
    again = client.completions.create(**kwargs, extra_body=NO_EOS)
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (54, 5)
    assert first.usage.total_tokens == 59
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == cacheable(54) == 52
    assert again.choices[0].text == first.choices[0].text
    assert first.choices[0].finish_reason == "length"


def test_streamed_completion_matches_and_ends_with_usage(client):
    prompt = "A streamed completion, with include_usage set."
    kwargs = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    plain = client.completions.create(**kwargs, extra_body=NO_EOS)
    chunks = list(
        client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert (chunks[-1].choices, usage.prompt_tokens, usage.completion_tokens) == ([], 47, 6)
    assert usage.prompt_tokens_details.cached_tokens == cacheable(47)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_uses_the_tokenizer_template_and_its_repeat_hits(client):
    messages = [
        {"role": "system", "content": "You are the chat test."},
        {"role": "user", "content": "Say something, twice over."},
    ]
    n = chat_prompt_tokens(messages)
    kwargs = {"model": SERVED_NAME, "messages": messages, "max_tokens": 4, "temperature": 0}
    first = client.chat.completions.create(**kwargs, extra_body=NO_EOS)
    again = client.chat.completions.create(**kwargs, extra_body=NO_EOS)
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (n, 4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == cacheable(n)
    assert first.choices[0].message.role == "assistant"
    assert again.choices[0].message.content == first.choices[0].message.content


def test_streamed_chat_sends_role_then_content_then_usage(client):
    messages = [{"role": "user", "content": "Stream a short chat answer please."}]
    n = chat_prompt_tokens(messages)
    kwargs = {"model": SERVED_NAME, "messages": messages, "max_tokens": 5, "temperature": 0}
    plain = client.chat.completions.create(**kwargs, extra_body=NO_EOS)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == plain.choices[0].message.content
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (n, 5, n + 5)
    assert usage.prompt_tokens_details.cached_tokens == cacheable(n)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)


def error_of(call) -> dict:
    """The OpenAI error object of a call that must be refused with a 400."""
    with pytest.raises(openai.BadRequestError) as info:
        call()
    body = info.value.body
    return body.get("error", body) if isinstance(body, dict) else {}


def test_errors_name_the_field_the_client_sent(client):
    chat, messages = client.chat.completions.create, [{"role": "user", "content": "hi"}]
    err = error_of(lambda: chat(model=SERVED_NAME, messages=messages, max_completion_tokens=7000))
    assert err["param"] == "max_completion_tokens"
    assert err["message"] == "max_completion_tokens is 7000; this server allows at most 6000"
    err = error_of(lambda: chat(model=SERVED_NAME, messages=messages, max_tokens=7000))
    assert err["param"] == "max_tokens"
    assert err["message"] == "max_tokens is 7000; this server allows at most 6000"
    err = error_of(lambda: chat(model=SERVED_NAME, messages=messages, max_tokens=1, seed=2**65))
    assert err["param"] == "seed"
    completion = client.completions.create
    err = error_of(lambda: completion(model=SERVED_NAME, prompt=[999_999], max_tokens=1))
    assert err["param"] == "prompt" and "token ids" in err["message"]


def test_a_request_past_the_models_positions_names_the_field_the_client_sent():
    with pytest.raises(ApiError) as info:
        max_new_tokens(255, 22, 6000, 256, "max_tokens", "messages")
    error = info.value
    assert (error.status, error.param, error.code) == (400, "max_tokens", "context_length_exceeded")
    assert "max_tokens (255)" in error.message and "max_new_tokens" not in error.message
    with pytest.raises(ApiError) as info:
        max_new_tokens(None, 256, 6000, 256, "max_completion_tokens", "messages")
    assert (info.value.param, info.value.code) == ("messages", "context_length_exceeded")
    assert max_new_tokens(None, 200, 6000, 256, "max_tokens", "prompt") == 56
    assert max_new_tokens(10, 200, 6000, None, "max_tokens", "prompt") == 10
