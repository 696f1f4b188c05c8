"""Fault 8: bad input through the HTTP API. A live `kvstore serve` process gets hypothesis-
generated requests, each a valid request with exactly one invalidating mutation: every one
must get a 4xx, /health must answer 200 after each, and the cache index must not change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from typing import NamedTuple

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from bench.faults.common import Context, FaultOutcome, wait_for
from bench.launch import free_port
from engine.api.openai import ChatMessage, ChatRequest, CompletionRequest, StreamOptions

MODEL, KEYS, KEY = "micro", {"sk-fuzz-a": "a", "sk-fuzz-b": "b"}, "sk-fuzz-a"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY, MAX_PROMPT, MAX_TOKENS = 16384, 200, 64  # the server's limits: what "huge" means
PER_REQUEST = 10  # generated requests per category = 10 x scale.requests
WARM = [(7 * i + 3) % 250 for i in range(41)]  # 10 whole blocks of 4 tokens can hit
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
FUZZED_PATHS = {COMPLETIONS, CHAT, "/v1/models", "/metrics"}  # /health takes no input
INDEX = {"device_cached": 'kvstore_device_blocks{state="cached"}',
         "device_free": 'kvstore_device_blocks{state="free"}',
         "device_evictable": 'kvstore_device_blocks{state="evictable"}',
         "stored_blocks": "kvstore_stored_blocks_total", "lookups": "kvstore_lookups_total",
         "requests_run": 'kvstore_requests_total{outcome="ok"}'}  # /metrics series  # fmt: skip


class Case(NamedTuple):
    category: str
    kind: str  # the mutation
    path: str
    content: bytes | None  # None: a GET
    headers: dict | None = None  # None: the valid key
    chunked: bool = False  # no Content-Length: the server must count while reading


def base(path: str) -> dict:
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


# ----------------------------------------------------------------------------- strategies

ENDPOINT = st.sampled_from([COMPLETIONS, CHAT])
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8))
FRACTION = st.floats(-1e6, 1e6).filter(lambda f: not f.is_integer())
JSON_TYPES = {
    "null": st.none(), "boolean": st.booleans(), "integer": st.integers(), "number": FRACTION,
    "string": st.text(max_size=12), "array": st.lists(SCALAR, max_size=3),
    "object": st.dictionaries(st.text(max_size=4), SCALAR, max_size=2),
}  # fmt: skip


def accepted(prop: dict) -> set[str]:
    """The JSON types a property of a pydantic JSON schema accepts; empty = any."""
    out = set()
    for option in prop.get("anyOf", [prop]):
        out.add(option.get("type", "object" if "$ref" in option else "any"))
    return set() if "any" in out else out | ({"integer"} if "number" in out else set())


def typed_fields() -> list[tuple[str, str, set[str]]]:
    """(endpoint, field, accepted JSON types) of every typed request field, nested ones too."""
    models = [(COMPLETIONS, "", CompletionRequest), (CHAT, "", ChatRequest),
              (CHAT, "messages.0.", ChatMessage), (COMPLETIONS, "stream_options.", StreamOptions),
              (CHAT, "stream_options.", StreamOptions)]  # fmt: skip
    return [
        (path, prefix + name, types)
        for path, prefix, model in models
        for name, prop in model.model_json_schema()["properties"].items()
        if (types := accepted(prop))
    ]


def sweep() -> list[Case]:
    """One wrong-typed value per documented field, so every field is covered at any scale."""
    sample = {"null": None, "boolean": True, "integer": 1, "number": 0.5, "string": "1",
              "array": [1], "object": {"a": 1}}  # fmt: skip
    wrong = [(f, next(t for t in sample if t not in f[2])) for f in typed_fields()]
    return [Case("wrong_types", t, *body(p, k, sample[t])) for (p, k, _), t in wrong]


def wrong_types() -> st.SearchStrategy[Case]:
    def wrong(field: tuple) -> st.SearchStrategy[tuple]:
        path, name, types = field
        return st.sampled_from([t for t in JSON_TYPES if t not in types]).flatmap(
            lambda t: JSON_TYPES[t].map(lambda v: body(path, name, v))
        )

    roles = ("system", "developer", "user", "assistant", "tool")
    return kinds("wrong_types", {
        "field type": st.sampled_from(typed_fields()).flatmap(wrong),
        "role": st.text(max_size=12).filter(lambda r: r not in roles).map(
            lambda r: body(CHAT, "messages.0.role", r)),
        "unknown model": st.builds(body, ENDPOINT, st.just("model"),
                                   st.text(max_size=12).filter(lambda m: m != MODEL)),
        "missing": st.sampled_from([(COMPLETIONS, "prompt"), (CHAT, "messages")]).map(
            lambda m: (m[0], dumps({k: v for k, v in base(m[0]).items() if k != m[1]}))),
    })  # fmt: skip


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
    return kinds("malformed_json", {
        "truncated": st.builds(lambda p, k: (p, dumps(base(p))[: k % len(dumps(base(p)))]),
                               ENDPOINT, st.integers(0, 10**6)),
        "trailing data": st.builds(lambda p, s: (p, dumps(base(p)) + s.encode()), ENDPOINT, junk),
        "random bytes": st.tuples(ENDPOINT, st.binary(max_size=256).filter(not_object)),
        "not an object": st.tuples(ENDPOINT, values.map(dumps)),
        "NaN literal": st.builds(lambda p, t: (p, dumps(base(p))[:-1] + t.encode()), ENDPOINT,
                                 tail),
        "deep nesting": st.builds(deep, ENDPOINT, st.integers(1000, MAX_BODY // 2 - 20),
                                  st.booleans()),
        "lone surrogate": st.builds(surrogate, ENDPOINT, st.booleans(),
                                    st.integers(0xD800, 0xDFFF)),
    })  # fmt: skip


def token_ids(vocab: int) -> st.SearchStrategy[Case]:
    good = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12)

    def mixed(bad: st.SearchStrategy) -> st.SearchStrategy[tuple]:
        def one(ids: list[int], i: int, value: object, batch: bool) -> tuple:
            ids = [*ids[: i % (len(ids) + 1)], value, *ids[i % (len(ids) + 1) :]]
            return body(COMPLETIONS, "prompt", [ids] if batch else ids)

        return st.builds(one, good, st.integers(0, 12), bad, st.booleans())

    return kinds("token_ids", {
        "out of vocab": mixed(st.integers(min_value=vocab)),
        "negative": mixed(st.integers(max_value=-1)), "fraction": mixed(FRACTION),
        "bool": mixed(st.booleans()), "string": mixed(st.text(max_size=4)),
        "null": mixed(st.none()), "nested": mixed(st.lists(st.integers(0, vocab - 1), max_size=2)),
        "empty": st.sampled_from([[], [[]], "", [""]]).map(
            lambda e: body(COMPLETIONS, "prompt", e)),
        "batch of 2+": st.lists(good, min_size=2, max_size=3).map(
            lambda b: body(COMPLETIONS, "prompt", b)),
    })  # fmt: skip


def huge(positions: int) -> st.SearchStrategy[Case]:
    n_long = st.integers(MAX_PROMPT + 1, 3 * MAX_PROMPT)
    asks = st.sampled_from([(COMPLETIONS, "max_tokens"), (CHAT, "max_tokens"),
                            (CHAT, "max_completion_tokens")])  # fmt: skip

    def padded(path: str, n: int, chunked: bool) -> tuple:  # valid JSON, over the byte limit
        return (path, dumps(base(path))[:-1] + b',"pad":"' + b"x" * n + b'"}', None, chunked)

    def fill(n: int) -> st.SearchStrategy[tuple]:  # prompt + max_tokens over the positions
        more = st.integers(positions - n + 1, MAX_TOKENS)
        prompt = {**base(COMPLETIONS), "prompt": (WARM * 5)[:n]}
        return more.map(lambda m: (COMPLETIONS, dumps({**prompt, "max_tokens": m})))

    return kinds("huge", {
        "prompt tokens": n_long.map(lambda n: body(COMPLETIONS, "prompt", (WARM * 15)[:n])),
        "prompt text": n_long.map(lambda n: body(COMPLETIONS, "prompt", "a" * n)),
        "chat content": n_long.map(lambda n: body(CHAT, "messages.0.content", "a" * n)),
        "body bytes": st.builds(padded, ENDPOINT, st.integers(MAX_BODY, 2 * MAX_BODY),
                                st.booleans()),
        "max_tokens": st.builds(lambda a, n: body(*a, n), asks, st.integers(MAX_TOKENS + 1)),
        "max_tokens <= 0": st.builds(lambda a, n: body(*a, n), asks, st.integers(max_value=0)),
        "over positions": st.integers(positions - MAX_TOKENS + 1, MAX_PROMPT).flatmap(fill),
        "seed over 64 bits": st.builds(body, ENDPOINT, st.just("seed"), st.one_of(
            st.integers(min_value=2**64), st.integers(max_value=-(2**63) - 1))),
    })  # fmt: skip


def salts() -> st.SearchStrategy[Case]:
    text = st.characters(codec="utf-8")
    value = st.one_of(st.booleans(), st.integers(), FRACTION, JSON_TYPES["array"].filter(bool),
                      JSON_TYPES["object"])  # fmt: skip
    odd = st.tuples(st.text(max_size=5), text.filter(lambda c: not c.isprintable()),
                    st.text(max_size=5)).map("".join)  # fmt: skip
    return kinds("salts", {
        "wrong type": st.builds(body, ENDPOINT, st.just("cache_salt"), value),
        "too long": st.builds(body, ENDPOINT, st.just("cache_salt"),
                              st.text(text.filter(str.isprintable), min_size=257, max_size=400)),
        "not printable": st.builds(body, ENDPOINT, st.just("cache_salt"), odd),
    })  # fmt: skip


def keys() -> st.SearchStrategy[Case]:
    """Valid requests on every keyed route with a bad Authorization header (latin-1, as
    HTTP carries it; no edge whitespace, which the client itself refuses to send)."""
    latin = st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f")
    token = st.text(latin.filter(lambda c: not 0x80 <= ord(c) < 0xA0), min_size=1, max_size=40)
    token = token.filter(lambda k: k == k.strip(" \t") and k.strip() not in KEYS)
    routes = st.sampled_from([COMPLETIONS, CHAT, "/v1/models", "/metrics"])

    def sent(header: st.SearchStrategy[dict]) -> st.SearchStrategy[tuple]:
        def one(path: str, h: dict) -> tuple:
            content = dumps(base(path)) if path in (COMPLETIONS, CHAT) else None
            return (path, content, {k: v.encode("latin-1") for k, v in h.items()})

        return st.builds(one, routes, header)

    bearer = lambda k: {"Authorization": f"Bearer {k}"}  # noqa: E731
    return kinds("keys", {
        "missing": sent(st.just({})),
        "wrong key": sent(token.map(bearer)),
        "wrong scheme": sent(st.sampled_from(["Basic", "Token", "bearer:", ""]).map(
            lambda s: {"Authorization": f"{s} {KEY}".strip()})),
        "no key": sent(st.sampled_from(["Bearer", "bearer", "BEARER"]).map(
            lambda s: {"Authorization": s})),
        "key + extra": sent(token.filter(lambda k: (KEY + k).strip() != KEY).map(
            lambda k: bearer(KEY + k))),
    })  # fmt: skip


# ----------------------------------------------------------------------------- the run


class Server:
    """`kvstore serve` on the micro model in its own process (no KVSTORE_* settings from the
    environment): tenants a and b, small body, prompt and max_tokens limits, keyed /metrics."""

    def __init__(self, ctx: Context):
        model_dir, keys_file = ctx.workdir / "http-model", ctx.workdir / "http-keys.json"
        ctx.model.model.save_pretrained(model_dir)
        ctx.model.tokenizer.save_pretrained(model_dir)
        keys_file.write_text(json.dumps(KEYS))
        port, self.log = free_port(), ctx.workdir / "http-server.log"
        self.args = [sys.executable, "-m", "engine.cli", "serve", "--model", str(model_dir),
                     "--served-model-name", MODEL, "--port", str(port), "--device", "cpu",
                     "--block-size", "4", "--device-blocks", "256", "--api-keys-file",
                     str(keys_file), "--metrics-require-key", "--max-body-bytes", str(MAX_BODY),
                     "--max-prompt-tokens", str(MAX_PROMPT), "--max-tokens-limit",
                     str(MAX_TOKENS), "--log-level", "warning"]  # fmt: skip
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30.0)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        with self.log.open("ab") as log:
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env)
        if not wait_for(lambda: not self.alive() or self.healthy(), 120.0) or not self.alive():
            self.__exit__()
            raise RuntimeError(f"kvstore serve did not start:\n{self.log.read_text()[-2000:]}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            if not wait_for(lambda: proc.poll() is not None, 20.0):
                proc.kill()
            proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            return self.client.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def send(self, case: Case) -> int | None:
        """The status of `case`'s request; None when the connection failed or timed out."""
        headers, content = AUTH if case.headers is None else case.headers, case.content
        if content is not None:
            headers = {**headers, "Content-Type": "application/json"}
        if case.chunked and content is not None:
            content = iter([content[i : i + 4096] for i in range(0, len(content), 4096)])
        try:
            method = "GET" if content is None else "POST"
            return self.client.request(
                method, case.path, content=content, headers=headers
            ).status_code
        except httpx.HTTPError:
            return None

    def index(self) -> dict[str, float]:
        """The /metrics series an admitted request moves, and the count of refused ones."""
        text = self.client.get("/metrics", headers=AUTH).text
        values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
        refused = sum(float(v) for k, v in values.items() if k.startswith("kvstore_requests_rej"))
        return {**{k: float(values.get(s, 0)) for k, s in INDEX.items()}, "refused": refused}

    def warm(self) -> int | None:
        """cached_tokens of a valid request for the warm prompt (None if it failed)."""
        r = self.client.post(COMPLETIONS, json={**base(COMPLETIONS), "prompt": WARM}, headers=AUTH)
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] if r.is_success else None


EXPECTED = {"keys": 401}  # the status each category must get; the exceptions by kind:
EXPECTED_KIND = {"unknown model": 404, "body bytes": 413}


def expected(case: Case) -> int:
    return EXPECTED_KIND.get(case.kind, EXPECTED.get(case.category, 400))


class Tally:
    """Sends cases; a case succeeds with its expected 4xx (400 for a bad body, 401 for a bad
    key, 404 for an unknown model, 413 for an oversized body) while the process lives and
    /health answers 200."""

    def __init__(self, server: Server):
        self.server, self.sent, self.ok, self.failures = server, 0, 0, []
        self.counts: Counter[str] = Counter()  # category_*, status_*

    def __call__(self, case: Case) -> None:
        status = self.server.send(case)
        ok = status == expected(case) and self.server.alive() and self.server.healthy()
        self.sent, self.ok = self.sent + 1, self.ok + ok
        self.counts.update([f"category_{case.category}", f"status_{status}"])
        if not ok and len(self.failures) < 5:
            self.failures.append(f"{case.category}/{case.kind} on {case.path}: {status}")


def fuzz(strategy: st.SearchStrategy[Case], n: int, tally: Tally) -> None:
    """Send `n` generated cases, recording each answer (nothing raises, so nothing shrinks)."""

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(strategy)
    def run(case: Case) -> None:
        tally(case)

    run()


def strategies(ctx: Context) -> dict[str, st.SearchStrategy[Case]]:
    return {"malformed_json": malformed(), "wrong_types": wrong_types(),
            "token_ids": token_ids(ctx.model.vocab_size),
            "huge": huge(ctx.model.max_positions or 256), "salts": salts(),
            "keys": keys()}  # fmt: skip


def http_fuzz(ctx: Context) -> FaultOutcome:
    """Every generated bad request gets a 4xx from a live server that stays healthy, and the
    index (device blocks, blocks stored, lookups, requests run) is the same afterwards."""
    n = PER_REQUEST * ctx.scale.requests
    with Server(ctx) as server:
        cold, hit = server.warm(), server.warm()
        before, tally = server.index(), Tally(server)
        for case in sweep():
            tally(case)
        for strategy in strategies(ctx).values():
            fuzz(strategy, n, tally)
        after, again = server.index(), server.warm()
        spec = server.client.get("/openapi.json")
    paths = set(spec.json()["paths"]) if spec.is_success else set()
    changed = sum(before[k] != after[k] for k in INDEX) + (again != hit or not hit)
    figures = {**dict(sorted(tally.counts.items())), "fields_swept": len(sweep()),
               **{f"{k}_before": v for k, v in before.items()},
               **{f"{k}_after": v for k, v in after.items()},
               "warm_cached_cold": cold, "warm_cached_before": hit, "warm_cached_after": again,
               "index_changed": changed, "openapi_paths": len(paths),
               "openapi_paths_fuzzed": len(paths & FUZZED_PATHS)}  # fmt: skip
    note = (f"{tally.ok}/{tally.sent} got their 4xx with /health 200 after; index series changed: "
            f"{changed}; warm prompt cached {hit} -> {again} tokens; the {len(paths)} OpenAPI "
            "paths list no body schemas (bodies are parsed by hand), so fields come from the "
            "request models; all paths but /health (no input) fuzzed")  # fmt: skip
    return FaultOutcome(
        "bad HTTP input (hypothesis)",
        f"{n} generated requests per category (malformed JSON, wrong types, token ids, huge, "
        "salts, keys), each one invalidating mutation of a valid request, plus one wrong-typed "
        "value per documented field, to a live `kvstore serve`",
        tally.sent, tally.ok, tally.sent - tally.ok + changed, 0, 0, 0,
        note="; ".join([note, *tally.failures]), figures=figures,
    )  # fmt: skip
