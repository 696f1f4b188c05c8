"""Hypothesis strategies of bad requests, one per category (malformed JSON, wrong types,
token ids, huge, salts, keys), each a valid request with exactly one invalidating mutation."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from bench.faults.common import Context
from bench.faults.http.cases import (
    BODY_PATHS,
    CHAT,
    COMPLETIONS,
    KEY,
    KEYS,
    MAX_BODY,
    MAX_PROMPT,
    MAX_TOKENS,
    MODEL,
    WARM,
    Case,
    base,
    body,
    dumps,
    kinds,
    typed_fields,
)

ENDPOINT = st.sampled_from([COMPLETIONS, CHAT])
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8))
FRACTION = st.floats(-1e6, 1e6).filter(lambda f: not f.is_integer())
JSON_TYPES = {
    "null": st.none(),
    "boolean": st.booleans(),
    "integer": st.integers(),
    "number": FRACTION,
    "string": st.text(max_size=12),
    "array": st.lists(SCALAR, max_size=3),
    "object": st.dictionaries(st.text(max_size=4), SCALAR, max_size=2),
}


def wrong_types() -> st.SearchStrategy[Case]:
    def wrong(field: tuple) -> st.SearchStrategy[tuple]:
        path, name, types = field
        return st.sampled_from([t for t in JSON_TYPES if t not in types]).flatmap(
            lambda t: JSON_TYPES[t].map(lambda v: body(path, name, v))
        )

    roles = ("system", "developer", "user", "assistant", "tool")
    return kinds(
        "wrong_types",
        {
            "field type": st.sampled_from(typed_fields()).flatmap(wrong),
            "role": st.text(max_size=12)
            .filter(lambda r: r not in roles)
            .map(lambda r: body(CHAT, "messages.0.role", r)),
            "unknown model": st.builds(
                body, ENDPOINT, st.just("model"), st.text(max_size=12).filter(lambda m: m != MODEL)
            ),
            "missing": st.sampled_from([(COMPLETIONS, "prompt"), (CHAT, "messages")]).map(
                lambda m: (m[0], dumps({k: v for k, v in base(m[0]).items() if k != m[1]}))
            ),
        },
    )


def malformed() -> st.SearchStrategy[Case]:
    def not_object(raw: bytes) -> bool:
        try:
            return not isinstance(json.loads(raw), dict)
        except (ValueError, RecursionError):
            return True

    def deep(path: str, depth: int, inside: bool) -> tuple:
        nest = "[" * depth + "]" * depth
        return (path, (f'{{"prompt": {nest}}}' if inside else nest).encode())

    def surrogate(path: str, user: bool, c: int) -> tuple:
        key = "user" if user else {COMPLETIONS: "prompt", CHAT: "messages.0.content"}[path]
        return body(path, key, chr(c))

    junk = st.text(min_size=1, max_size=40).filter(lambda s: s.strip(" \t\n\r"))
    values = st.recursive(SCALAR, lambda c: st.lists(c, max_size=3), max_leaves=6)
    tail = st.sampled_from(["NaN", "Infinity", "-Infinity"]).map(lambda c: f',"metadata":{c}}}')
    return kinds(
        "malformed_json",
        {
            "truncated": st.builds(
                lambda p, k: (p, dumps(base(p))[: k % len(dumps(base(p)))]),
                ENDPOINT,
                st.integers(0, 10**6),
            ),
            "trailing data": st.builds(
                lambda p, s: (p, dumps(base(p)) + s.encode()), ENDPOINT, junk
            ),
            "random bytes": st.tuples(ENDPOINT, st.binary(max_size=256).filter(not_object)),
            "not an object": st.tuples(ENDPOINT, values.map(dumps)),
            "NaN literal": st.builds(
                lambda p, t: (p, dumps(base(p))[:-1] + t.encode()), ENDPOINT, tail
            ),
            "deep nesting": st.builds(
                deep, ENDPOINT, st.integers(1000, MAX_BODY // 2 - 20), st.booleans()
            ),
            "lone surrogate": st.builds(
                surrogate, ENDPOINT, st.booleans(), st.integers(0xD800, 0xDFFF)
            ),
        },
    )


def token_ids(vocab: int) -> st.SearchStrategy[Case]:
    good = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12)

    def mixed(bad: st.SearchStrategy) -> st.SearchStrategy[tuple]:
        def one(ids: list[int], i: int, value: object, batch: bool) -> tuple:
            ids = [*ids[: i % (len(ids) + 1)], value, *ids[i % (len(ids) + 1) :]]
            return body(COMPLETIONS, "prompt", [ids] if batch else ids)

        return st.builds(one, good, st.integers(0, 12), bad, st.booleans())

    return kinds(
        "token_ids",
        {
            "out of vocab": mixed(st.integers(min_value=vocab)),
            "negative": mixed(st.integers(max_value=-1)),
            "fraction": mixed(FRACTION),
            "bool": mixed(st.booleans()),
            "string": mixed(st.text(max_size=4)),
            "null": mixed(st.none()),
            "nested": mixed(st.lists(st.integers(0, vocab - 1), max_size=2)),
            "empty": st.sampled_from([[], [[]], "", [""]]).map(
                lambda e: body(COMPLETIONS, "prompt", e)
            ),
            "batch of 2+": st.lists(good, min_size=2, max_size=3).map(
                lambda b: body(COMPLETIONS, "prompt", b)
            ),
        },
    )


def huge(positions: int) -> st.SearchStrategy[Case]:
    n_long = st.integers(MAX_PROMPT + 1, 3 * MAX_PROMPT)
    asks = st.sampled_from(
        [(COMPLETIONS, "max_tokens"), (CHAT, "max_tokens"), (CHAT, "max_completion_tokens")]
    )

    def padded(path: str, n: int, chunked: bool) -> tuple:  # valid JSON, over the byte limit
        return (path, dumps(base(path))[:-1] + b',"pad":"' + b"x" * n + b'"}', None, chunked)

    def fill(n: int) -> st.SearchStrategy[tuple]:  # prompt + max_tokens over the positions
        more = st.integers(positions - n + 1, MAX_TOKENS)
        prompt = {**base(COMPLETIONS), "prompt": (WARM * 5)[:n]}
        return more.map(lambda m: (COMPLETIONS, dumps({**prompt, "max_tokens": m})))

    return kinds(
        "huge",
        {
            "prompt tokens": n_long.map(lambda n: body(COMPLETIONS, "prompt", (WARM * 15)[:n])),
            "prompt text": n_long.map(lambda n: body(COMPLETIONS, "prompt", "a" * n)),
            "chat content": n_long.map(lambda n: body(CHAT, "messages.0.content", "a" * n)),
            "body bytes": st.builds(
                padded, ENDPOINT, st.integers(MAX_BODY, 2 * MAX_BODY), st.booleans()
            ),
            "max_tokens": st.builds(lambda a, n: body(*a, n), asks, st.integers(MAX_TOKENS + 1)),
            "max_tokens <= 0": st.builds(lambda a, n: body(*a, n), asks, st.integers(max_value=0)),
            "over positions": st.integers(positions - MAX_TOKENS + 1, MAX_PROMPT).flatmap(fill),
            "seed over 64 bits": st.builds(
                body,
                ENDPOINT,
                st.just("seed"),
                st.one_of(st.integers(min_value=2**64), st.integers(max_value=-(2**63) - 1)),
            ),
        },
    )


def salts() -> st.SearchStrategy[Case]:
    text = st.characters(codec="utf-8")
    value = st.one_of(
        st.booleans(),
        st.integers(),
        FRACTION,
        JSON_TYPES["array"].filter(bool),
        JSON_TYPES["object"],
    )
    odd = st.tuples(
        st.text(max_size=5), text.filter(lambda c: not c.isprintable()), st.text(max_size=5)
    ).map("".join)
    return kinds(
        "salts",
        {
            "wrong type": st.builds(body, ENDPOINT, st.just("cache_salt"), value),
            "too long": st.builds(
                body,
                ENDPOINT,
                st.just("cache_salt"),
                st.text(text.filter(str.isprintable), min_size=257, max_size=400),
            ),
            "not printable": st.builds(body, ENDPOINT, st.just("cache_salt"), odd),
        },
    )


def keys() -> st.SearchStrategy[Case]:
    """Valid requests on every keyed route with a bad Authorization or x-api-key header
    (latin-1, as HTTP carries it; no edge whitespace, which the client itself refuses to
    send)."""
    latin = st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f")
    token = st.text(latin.filter(lambda c: not 0x80 <= ord(c) < 0xA0), min_size=1, max_size=40)
    token = token.filter(lambda k: k == k.strip(" \t") and k.strip() not in KEYS)
    routes = st.sampled_from([*BODY_PATHS, "/v1/models", "/metrics"])

    def sent(header: st.SearchStrategy[dict]) -> st.SearchStrategy[tuple]:
        def one(path: str, h: dict) -> tuple:
            content = dumps(base(path)) if path in BODY_PATHS else None
            return (path, content, {k: v.encode("latin-1") for k, v in h.items()})

        return st.builds(one, routes, header)

    bearer = lambda k: {"Authorization": f"Bearer {k}"}  # noqa: E731
    return kinds(
        "keys",
        {
            "missing": sent(st.just({})),
            "wrong key": sent(token.map(bearer)),
            "wrong x-api-key": sent(token.map(lambda k: {"x-api-key": k})),
            "wrong scheme": sent(
                st.sampled_from(["Basic", "Token", "bearer:", ""]).map(
                    lambda s: {"Authorization": f"{s} {KEY}".strip()}
                )
            ),
            "no key": sent(
                st.sampled_from(["Bearer", "bearer", "BEARER"]).map(lambda s: {"Authorization": s})
            ),
            "key + extra": sent(
                token.filter(lambda k: (KEY + k).strip() != KEY).map(lambda k: bearer(KEY + k))
            ),
        },
    )


def strategies(ctx: Context) -> dict[str, st.SearchStrategy[Case]]:
    return {
        "malformed_json": malformed(),
        "wrong_types": wrong_types(),
        "token_ids": token_ids(ctx.model.vocab_size),
        "huge": huge(ctx.model.max_positions or 256),
        "salts": salts(),
        "keys": keys(),
    }
