"""A live `kvstore serve` (the batched engine) on the micro model with LMDB and the private
Redis, and streaming clients for it: what the concurrent fault scenarios run on.

Every client streams a completion of token ids with `return_token_ids`, so its output can be
checked against the micro model's own no-cache forward; an answer is one `Answer`: its
status, TTFT, token ids, or the reason it was refused or broke.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.faults.common import BS, Context
from bench.launch import ServerProcess, free_port, metric_series
from engine.model.loading import byte_tokenizer

MODEL = "micro"
KEYS = {"sk-load-a": "a", "sk-load-b": "b"}
DRAIN_S = 30.0
SCRATCH_BLOCKS = 1  # the batched runner holds one block for K/V it must not write


@dataclass
class Answer:
    prompt: list[int]
    sent_at: float  # perf_counter
    key: str = "sk-load-a"  # its API key (the tenant: cache salts differ by tenant)
    status: int | None = None  # None: no HTTP answer (connection refused or broken)
    ttft_s: float | None = None
    token_ids: list[int] | None = None
    finish: str | None = None
    error: str | None = None  # a refusal's code, or why the stream broke
    cancelled: bool = False  # the client left on purpose
    replica: str | None = None  # behind a router: the replica that answered

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.token_ids is not None and self.error is None


def model_dir(ctx: Context) -> Path:
    """The micro model the scenarios check against, saved once for `kvstore serve`."""
    path = ctx.workdir / "micro-model"
    if not (path / "config.json").exists():
        ctx.model.model.save_pretrained(path)
        byte_tokenizer().save_pretrained(path)
    return path


class LiveServer(ServerProcess):
    """`kvstore serve` on the micro model, LMDB under the workdir and the private Redis."""

    def __init__(self, ctx: Context, tag: str, *extra: str, redis: bool = True):
        port, keys = free_port(), ctx.workdir / "load-keys.json"
        keys.write_text(json.dumps(KEYS))
        args = [sys.executable, "-m", "engine.cli", "serve", "--model", str(model_dir(ctx)),
                "--served-model-name", MODEL, "--port", str(port), "--device", "cpu",
                "--block-size", str(BS), "--api-keys-file", str(keys), "--log-level", "info",
                "--lmdb-dir", str(ctx.workdir / f"lmdb-{tag}"), "--lookup-deadline-ms", "100",
                "--breaker-cooldown-s", "1", "--drain-timeout-s", str(DRAIN_S), *extra]  # fmt: skip
        if redis:
            args += ["--redis-url", ctx.redis.url]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        log = ctx.workdir / f"serve-{tag}.log"
        super().__init__(args, port, log, {**env, "KVSTORE_SECRET": "load-secret"})
        self.client = httpx.Client(base_url=self.url, timeout=30.0)

    def metrics(self) -> dict[str, float]:
        return metric_series(self.client.get("/metrics").text)

    def held_blocks(self) -> int:
        """Device blocks referenced by a request (0 once every request ended): neither free,
        evictable nor a kept tail, less the batched runner's one scratch block."""
        m = self.metrics()
        states = ("total", "free", "evictable", "tails")
        blocks = {s: m[f'kvstore_device_blocks{{state="{s}"}}'] for s in states}
        held = blocks["total"] - blocks["free"] - blocks["evictable"] - blocks["tails"]
        return int(held) - SCRATCH_BLOCKS

    def health(self) -> dict:
        try:
            return self.client.get("/health", timeout=5.0).json()
        except (httpx.HTTPError, ValueError):
            return {"status": "unreachable"}

    def misses(self, done: set[tuple[tuple[int, ...], str]]) -> int:
        """How many (prompt, API key) pairs this server does not hit in full: every whole
        block but the last token's (which is always computed)."""
        short = 0
        for prompt, key in done:
            body = {"model": MODEL, "prompt": list(prompt), "max_tokens": 1}
            r = self.client.post(
                "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            short += cached < (len(prompt) - 1) // BS * BS
        return short

    def shut_down(self) -> tuple[bool, int | None, float]:
        """SIGTERM, wait for the exit: (integrity ok, blocks held at close, seconds)."""
        start = time.perf_counter()
        self.stop(timeout_s=DRAIN_S + 15)
        took = time.perf_counter() - start
        self.client.close()
        log = self.log_tail(200_000)
        marker = "cache integrity ok; "
        if marker not in log:
            return False, None, took
        held = int(log.rsplit(marker, 1)[1].split(" ", 1)[0])
        return True, held, took


def body(prompt: Sequence[int], max_tokens: int) -> dict:
    return {
        "model": MODEL,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        "ignore_eos": True,
    }


class Streaming:
    """How many of a run's streams have their first chunk and have not ended, as the clients
    see it (thread-safe), and the most that ran at once since `mark`: a fault waits on that
    peak without polling the server, so neither a workload shorter than a poll nor a waiter
    woken after the streams ended again can slip by unseen."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._now = 0
        self._peak = 0  # the most at once since `mark`

    def change(self, by: int) -> None:
        with self._cond:
            self._now += by
            self._peak = max(self._peak, self._now)
            self._cond.notify_all()

    def mark(self) -> None:
        """Count the peak from now on (the streams running now are its floor)."""
        with self._cond:
            self._peak = self._now

    def wait_for(self, n: int, timeout_s: float) -> bool:
        """Whether `n` streams ran at once at some moment since `mark`, waiting up to
        `timeout_s` for it."""
        with self._cond:
            return self._cond.wait_for(lambda: self._peak >= n, timeout_s)


def stream(
    url: str,
    prompt: list[int],
    max_tokens: int,
    key: str = "sk-load-a",
    leave_after: int | None = None,
    payload: bytes | None = None,
    streaming: Streaming | None = None,
) -> Answer:
    """One streamed completion; `leave_after` chunks: the client disconnects; `payload`: send
    these bytes instead of the request (bad input); `streaming` counts it while it streams."""
    answer = Answer(prompt, time.perf_counter(), key)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    content = payload if payload is not None else json.dumps(body(prompt, max_tokens)).encode()
    try:
        with httpx.stream(
            "POST", f"{url}/v1/completions", content=content, headers=headers, timeout=120.0
        ) as response:
            answer.status = response.status_code
            answer.replica = response.headers.get("x-kvstore-replica")
            if response.status_code != 200:
                response.read()
                answer.error = _error_code(response)
                return answer
            try:
                _read_events(response, answer, leave_after, streaming)
            finally:  # counted from its first chunk (in _read_events) to here, however it ends
                if streaming is not None and answer.ttft_s is not None:
                    streaming.change(-1)
    except httpx.HTTPError as e:
        answer.error = answer.error or f"{type(e).__name__}"
    return answer


def _error_code(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        return str(error.get("code") or error.get("type"))
    except (ValueError, KeyError, TypeError):
        return f"http {response.status_code}"


def _read_events(
    response: httpx.Response,
    answer: Answer,
    leave_after: int | None,
    streaming: Streaming | None = None,
) -> None:
    chunks = 0
    for line in response.iter_lines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            answer.error = str(event["error"].get("code") or event["error"].get("type"))
            return
        chunks += 1
        if answer.ttft_s is None:
            answer.ttft_s = time.perf_counter() - answer.sent_at
            if streaming is not None:
                streaming.change(1)
        if leave_after is not None and chunks >= leave_after:
            answer.cancelled = True
            return  # closing the response disconnects
        choice = event["choices"][0]
        if choice.get("finish_reason") is not None:
            answer.finish, answer.token_ids = choice["finish_reason"], choice.get("token_ids")


Job = Callable[[], Answer]


def run_clients(jobs: Sequence[Job], concurrency: int, during: Callable[[], None] | None = None):
    """Run `jobs` on `concurrency` client threads; `during` runs on this thread meanwhile
    (the fault). Returns the answers in job order."""
    with ThreadPoolExecutor(concurrency, thread_name_prefix="load-client") as pool:
        futures = [pool.submit(job) for job in jobs]
        if during is not None:
            during()
        return [f.result() for f in futures]


def wait_until(
    condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.05
) -> float | None:
    """Seconds until `condition` held (polled every `interval_s`); None if it never did."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if condition():
            return time.perf_counter() - start
        time.sleep(interval_s)
    return None
