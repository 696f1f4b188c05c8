"""The cases of the HTTP fault: valid requests to a live `kvstore serve` and the one
invalidating mutation each case applies, plus the sweep of one wrong-typed value per
documented request field."""

from __future__ import annotations

import json
from typing import NamedTuple

from hypothesis import strategies as st

from engine.api.anthropic import CountTokensRequest, Message, MessagesRequest
from engine.api.openai import ChatMessage, ChatRequest, CompletionRequest, StreamOptions

MODEL, KEYS, KEY = "micro", {"sk-fuzz-a": "a", "sk-fuzz-b": "b"}, "sk-fuzz-a"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY, MAX_PROMPT, MAX_TOKENS = 16384, 200, 64  # the server's limits: what "huge" means
WARM = [(7 * i + 3) % 250 for i in range(41)]  # 10 whole blocks of 4 tokens can hit
COMPLETIONS, CHAT, MESSAGES = "/v1/completions", "/v1/chat/completions", "/v1/messages"
COUNT_TOKENS = MESSAGES + "/count_tokens"
BODY_PATHS = (COMPLETIONS, CHAT, MESSAGES, COUNT_TOKENS)


class Case(NamedTuple):
    category: str
    kind: str  # the mutation
    path: str
    content: bytes | None  # None: a GET
    headers: dict | None = None  # None: the valid key
    chunked: bool = False  # no Content-Length: the server must count while reading


def base(path: str) -> dict:
    """A valid body of `path` (chat's is also a valid Anthropic message and token count)."""
    if path == COMPLETIONS:
        return {"model": MODEL, "prompt": WARM[:9], "max_tokens": 2, "temperature": 0}
    msgs = [{"role": "user", "content": "hi"}]
    return {"model": MODEL, "messages": msgs, "max_tokens": 2, "temperature": 0}


def dumps(body: object) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # ASCII: a lone surrogate stays \udXXX


def body(path: str, key: str | None = None, value: object = None) -> tuple[str, bytes]:
    """(path, content) of the valid body with `key` (dotted when nested) set to `value`."""
    data = base(path)
    if key is not None and key.startswith(("messages.0.", "stream_options.")):
        outer, _, inner = key.partition(".0." if key.startswith("m") else ".")
        data[outer] = [{**data[outer][0], inner: value}] if outer == "messages" else {inner: value}
    elif key is not None:
        data[key] = value
    return path, dumps(data)


def kinds(category: str, table: dict[str, st.SearchStrategy[tuple]]) -> st.SearchStrategy[Case]:
    """A mutation of `table` (kind -> strategy of the Case's path, content, ...), uniformly."""
    return st.sampled_from(list(table)).flatmap(
        lambda k: table[k].map(lambda fields: Case(category, k, *fields))
    )


def accepted(prop: dict) -> set[str]:
    """The JSON types a property of a pydantic JSON schema accepts; empty = any."""
    out = set()
    for option in prop.get("anyOf", [prop]):
        out.add(option.get("type", "object" if "$ref" in option else "any"))
    return set() if "any" in out else out | ({"integer"} if "number" in out else set())


def typed_fields() -> list[tuple[str, str, set[str]]]:
    """(endpoint, field, accepted JSON types) of every typed request field, nested ones too."""
    models = [
        (COMPLETIONS, "", CompletionRequest),
        (CHAT, "", ChatRequest),
        (CHAT, "messages.0.", ChatMessage),
        (COMPLETIONS, "stream_options.", StreamOptions),
        (CHAT, "stream_options.", StreamOptions),
        (MESSAGES, "", MessagesRequest),
        (MESSAGES, "messages.0.", Message),
        (COUNT_TOKENS, "", CountTokensRequest),
        (COUNT_TOKENS, "messages.0.", Message),
    ]
    return [
        (path, prefix + name, types)
        for path, prefix, model in models
        for name, prop in model.model_json_schema()["properties"].items()
        if (types := accepted(prop))
    ]


def sweep() -> list[Case]:
    """One wrong-typed value per documented field, so every field is covered at any scale."""
    sample = {
        "null": None,
        "boolean": True,
        "integer": 1,
        "number": 0.5,
        "string": "1",
        "array": [1],
        "object": {"a": 1},
    }
    cases = []
    for endpoint, field, types in typed_fields():
        kind = next(t for t in sample if t not in types)
        path, content = body(endpoint, field, sample[kind])
        cases.append(Case(category="wrong_types", kind=kind, path=path, content=content))
    return cases
