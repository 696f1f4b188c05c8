"""Anthropic's Messages API pieces without a server: the request's validation and
conversation, the breakpoints' token positions, the usage arithmetic, the stop reasons, the
error shape, and OpenAI's prompt-caching fields."""

from __future__ import annotations

import pytest

from engine.api import anthropic_responses as ar
from engine.api import openai as p
from engine.api.anthropic import parse_messages
from engine.api.breakpoints import Retention, retention
from engine.api.errors import ApiError, anthropic_body, error_body, stream_error
from engine.api.prompts import prompt_ids
from engine.model.loading import byte_tokenizer

SYSTEM = "S" * 50  # byte tokenizer: one token a character
EPHEMERAL = {"type": "ephemeral"}


def body(**fields) -> dict:
    base = {"model": "micro", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return base | fields


def refusal(data: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_messages(data)
    assert info.value.status == 400
    return info.value


def test_system_blocks_and_text_blocks_render_as_the_chat_template_renders_messages():
    tok = byte_tokenizer()
    req = parse_messages(body(
        system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "q"}]},
                  {"role": "assistant", "content": "r"},
                  {"role": "user", "content": "s"}, {"role": "user", "content": "t"}],
    ))  # fmt: skip
    text = "<|bos|>system: a\nb<|end_of_turn|>\nuser: q<|end_of_turn|>\n"
    text += "assistant: r<|end_of_turn|>\nuser: s\nt<|end_of_turn|>\nassistant: "  # s, t: one turn
    assert tok.decode(prompt_ids(tok, req)) == text


def test_a_system_breakpoint_sits_after_the_system_turn_and_its_end_of_turn():
    tok = byte_tokenizer()
    system = [{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}]
    req = parse_messages(body(system=system))
    ids = prompt_ids(tok, req)
    # <|bos|> "system: " SYSTEM <|end_of_turn|> "\n": then "user" and "assistant" differ
    assert retention(tok, req, ids) == [Retention(1 + 8 + 50 + 2, 300.0)]


def test_a_breakpoint_inside_a_message_sits_after_its_block():
    tok = byte_tokenizer()
    hour = {"type": "ephemeral", "ttl": "1h"}
    content = [{"type": "text", "text": "first", "cache_control": hour},
               {"type": "text", "text": "second", "cache_control": EPHEMERAL}]  # fmt: skip
    req = parse_messages(body(system=SYSTEM, messages=[{"role": "user", "content": content}]))
    ids = prompt_ids(tok, req)
    start = 1 + 8 + 50 + 2 + len("user: ")
    assert len(ids) == start + len("first\nsecond") + 2 + len("assistant: ")
    # the last block's cut is the whole conversation: the whole prompt, which the next turn
    # (this prompt, the answer, more) repeats
    assert retention(tok, req, ids) == [Retention(start + 5, 3600.0), Retention(len(ids), 300.0)]


def test_usage_counts_whole_blocks_up_to_the_furthest_breakpoint():
    five = [(61, 300.0)]
    first = ar.usage(prompt_tokens=90, cached_tokens=0, output_tokens=5, breakpoints=five,
                     block_size=4)  # fmt: skip
    assert first == ar.Usage(input_tokens=30, cache_creation_input_tokens=60,
                             cache_read_input_tokens=0, output_tokens=5,
                             creation_by_ttl={"5m": 60})  # fmt: skip
    again = ar.usage(prompt_tokens=90, cached_tokens=64, output_tokens=5, breakpoints=five,
                     block_size=4)  # fmt: skip
    assert again == ar.Usage(26, 0, 64, 5, {})
    partly = ar.usage(prompt_tokens=90, cached_tokens=8, output_tokens=1, breakpoints=five,
                      block_size=16)  # fmt: skip
    assert partly == ar.Usage(42, 40, 8, 1, {"5m": 40})
    assert ar.usage(90, 12, 3, [], 4) == ar.Usage(78, 0, 12, 3, {})  # no breakpoint: no writes


def test_cache_writes_are_split_by_the_ttl_of_the_breakpoint_they_reach():
    """A 1-hour breakpoint at 21 and a 5-minute one at 61 (blocks of 4): 20 tokens written
    for an hour, 40 more for 5 minutes; what was cached already is written by nobody."""
    both = [(61, 300.0), (21, 3600.0)]
    cold = ar.usage(90, 0, 5, both, 4)
    assert cold.creation_by_ttl == {"1h": 20, "5m": 40} and cold.cache_creation_input_tokens == 60
    assert cold.body()["cache_creation"] == {"ephemeral_5m_input_tokens": 40,
                                             "ephemeral_1h_input_tokens": 20}  # fmt: skip
    warm = ar.usage(90, 32, 5, both, 4)  # the 1-hour part cached already, and 12 more
    assert warm.creation_by_ttl == {"5m": 28}
    assert ar.usage(90, 0, 5, [], 4).body()["cache_creation"] == {
        "ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}  # fmt: skip


def test_the_stop_reason_names_the_stop_sequence_found_where_the_text_was_cut():
    assert ar.stop_of("stop", "ab", "abXYc", ["Q", "XY"]) == ar.Stop("stop_sequence", "XY")
    assert ar.stop_of("stop", "ab", "ab", ["XY"]) == ar.Stop("end_turn", None)
    assert ar.stop_of("length", "abc", "abc", []) == ar.Stop("max_tokens", None)


@pytest.mark.parametrize(
    ("fields", "message_start"),
    [
        ({"max_tokens": None}, "max_tokens: "),
        ({"temperature": 1.5}, "temperature: "),
        ({"tools": [{"name": "x"}]}, "tools: tool use is not supported"),
        ({"tool_choice": {"type": "auto"}}, "tool_choice: "),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking: "),
        ({"top_k": 5}, "top_k: "),
        ({"stop_sequences": [""]}, "stop_sequences: "),
        ({"messages": []}, "messages: "),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "messages: the last message"),
        ({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image", "source": {"type": "base64", "data": ""}}]}]},
         "messages.0.content.1.type: content blocks of type 'image' are not supported"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "1"}]}]},
         "messages.0.content.0.type: content blocks of type 'tool_result'"),
        ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "persistent"}}]},
         "system.0.cache_control.type: cache_control type 'persistent' is unknown"),
        ({"system": [{"type": "text", "text": "s",
                      "cache_control": {"type": "ephemeral", "ttl": "10m"}}]},
         "system.0.cache_control.ttl: cache_control ttl '10m' is unknown"),
        ({"system": [{"type": "text", "text": str(i), "cache_control": EPHEMERAL}
                     for i in range(5)]},
         "cache_control: 5 blocks have cache_control; at most 4"),
    ],
)  # fmt: skip
def test_bad_requests_are_refused_naming_the_field(fields, message_start):
    data = {k: v for k, v in (body() | fields).items() if v is not None}
    error = refusal(data)
    assert anthropic_body(error)["error"]["message"].startswith(message_start)
    assert anthropic_body(error)["error"]["type"] == "invalid_request_error"


def test_errors_on_the_messages_path_are_in_anthropic_shape_and_others_in_openai_shape():
    busy = ApiError(429, "the server is busy", type="rate_limit_error", code="queue_full")
    assert error_body(busy, "/v1/messages") == {
        "type": "error", "error": {"type": "rate_limit_error", "message": "the server is busy"}
    }  # fmt: skip
    assert error_body(busy, "/v1/chat/completions") == busy.body()
    closing = ApiError(503, "closing", type="server_error")
    assert error_body(closing, "/v1/messages/count_tokens")["error"]["type"] == "overloaded_error"
    assert error_body(ApiError(500, "boom"), "/v1/messages")["error"]["type"] == "api_error"
    assert error_body(ApiError(413, "big"), "/v1/messages")["error"]["type"] == "request_too_large"
    event = stream_error(busy, "/v1/messages")
    assert event.startswith("event: error\ndata: {") and event.endswith("}\n\n")


def test_prompt_cache_retention_takes_its_two_values_only():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert p.parse_body(p.ChatRequest, chat).retention_ttl_s is None
    in_memory = chat | {"prompt_cache_retention": "in_memory"}
    assert p.parse_body(p.ChatRequest, in_memory).retention_ttl_s is None
    day = {"prompt": "x", "prompt_cache_retention": "24h"}
    assert p.parse_body(p.CompletionRequest, day).retention_ttl_s == 86400.0
    for bad in ("1h", "24H", 24, ""):
        with pytest.raises(ApiError) as info:
            p.parse_body(p.ChatRequest, chat | {"prompt_cache_retention": bad})
        assert (info.value.status, info.value.param) == (400, "prompt_cache_retention")


def test_prompt_cache_key_is_a_short_string():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    longest = p.parse_body(p.ChatRequest, chat | {"prompt_cache_key": "k" * 64})
    assert longest.prompt_cache_key == "k" * 64
    for bad in ("k" * 65, "", 7, ["k"]):
        with pytest.raises(ApiError) as info:
            p.parse_body(p.CompletionRequest, {"prompt": "x", "prompt_cache_key": bad})
        assert (info.value.status, info.value.param) == (400, "prompt_cache_key")


def test_a_top_level_cache_control_marks_the_last_block():
    tok = byte_tokenizer()
    req = parse_messages(body(system=SYSTEM, cache_control={"type": "ephemeral", "ttl": "1h"}))
    ids = prompt_ids(tok, req)
    assert retention(tok, req, ids) == [Retention(len(ids), 3600.0)]
    error = refusal(body(cache_control={"type": "ephemeral", "ttl": "2h"}))
    assert error.param == "cache_control.ttl"
