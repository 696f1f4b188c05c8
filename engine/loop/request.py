"""One request from the HTTP route (or `Engine.submit`) to the engine, and how it samples.

A `Request` carries what was asked (validated token ids, sampling, salt, tenant, callback)
and where it stands (admitted, output so far, first token, cancelled); its `future`
resolves to a `GenerateResult`.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

Prompt = str | Sequence[int]
TokenCallback = Callable[[int], None]
MAX_LOGPROBS = 20  # most alternatives a request may ask logprobs of (engine/loop/logprobs.py)


class InvalidRequestError(ValueError):
    """A request is malformed; the message says what to fix, `field` which of the engine's
    fields (a `SamplingParams` field, `prompt`) when one is to blame."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class EngineClosedError(RuntimeError):
    """The engine was closed; no more requests are accepted."""


def _int_tuple(name: str, values: Sequence[int]) -> tuple[int, ...]:
    out = tuple(values)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in out):
        raise InvalidRequestError(f"{name} must be non-negative ints, got {values!r}")
    return out


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. temperature 0 = greedy (top_p and seed then unused)."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before the first one
    ignore_eos: bool = False
    # logprobs of the raw distribution (engine/loop/logprobs.py); None: not computed
    logprobs: int | None = None  # of each sampled token, with this many top alternatives
    prompt_logprobs: int | None = None  # of each prompt token, with this many alternatives

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise InvalidRequestError(
                f"max_new_tokens must be an int >= 1, got {n!r}", "max_new_tokens"
            )
        if not isinstance(self.temperature, int | float) or not 0 <= self.temperature <= 100:
            why = f"temperature must be in [0, 100], got {self.temperature!r}"
            raise InvalidRequestError(why, "temperature")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not -(2**63) <= self.seed < 2**64  # what torch.Generator.manual_seed takes
        ):
            why = f"seed must be a 64-bit int or None, got {self.seed!r}"
            raise InvalidRequestError(why, "seed")
        object.__setattr__(
            self, "stop_token_ids", _int_tuple("stop_token_ids", self.stop_token_ids)
        )
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidRequestError(f"stop must be non-empty strings, got {self.stop!r}", "stop")
        object.__setattr__(self, "stop", stop)
        for name in ("logprobs", "prompt_logprobs"):
            _check_logprobs(name, getattr(self, name))


def _check_logprobs(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        why = f"{name} must be an int in [0, {MAX_LOGPROBS}] or None, got {value!r}"
        raise InvalidRequestError(why, name)


class Retain(NamedTuple):
    """Keep the cached blocks of the prompt's first `num_tokens` tokens for `ttl_s` seconds
    (a client's cache_control breakpoint or prompt_cache_retention, engine/api/)."""

    num_tokens: int
    ttl_s: float


class TokenLogprob(NamedTuple):
    """One sampled token: its logprob and the `logprobs` most likely tokens."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


class PromptLogprobs(NamedTuple):
    """A prompt's logprobs, one entry per prompt token; the first token's are None."""

    logprobs: list[float | None]
    ranks: list[int | None]  # 1 + how many tokens were more likely
    top: list[list[tuple[int, float]] | None]  # the `prompt_logprobs` most likely


class GenerateResult(NamedTuple):
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was loaded from the cache
    output_token_ids: list[int]
    text: str
    ttft_s: float  # lookup + load + suffix prefill + first token
    finish_reason: str  # "stop" or "length"
    cached_by_tier: dict[str, int]  # cached tokens by source tier ("device", "lmdb", ...)
    queue_s: float  # time from submit until the worker started the request
    output_logprobs: list[TokenLogprob] | None = None  # when params.logprobs is set
    prompt_logprobs: PromptLogprobs | None = None  # when params.prompt_logprobs is set


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        if self.params.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / self.params.temperature, dim=-1)
        if self.params.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            drop = torch.cumsum(sorted_probs, -1) - sorted_probs > self.params.top_p
            probs[order[drop]] = 0.0  # the top token always stays
        return int(torch.multinomial(probs, 1, generator=self.generator))


class StopChecker:
    """When a request's output is done: a stop string (the text is cut before it), a stop or
    EOS token, or max_new_tokens. Stop strings decode the text so far at each token."""

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int], tokenizer: Any):
        self.params = params
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids.update(eos_token_ids)
        self.decode = functools.partial(tokenizer.decode, skip_special_tokens=True)

    def __call__(self, output: list[int]) -> tuple[str, str] | None:
        """(finish_reason, text), or None to go on."""
        if self.params.stop:
            text = self.decode(output)
            cut = min((i for s in self.params.stop if (i := text.find(s)) >= 0), default=None)
            if cut is not None:
                return "stop", text[:cut]
        if output[-1] in self.stop_ids:
            return "stop", self.decode(output)
        if len(output) >= self.params.max_new_tokens:
            return "length", self.decode(output)
        return None


class RequestCancelled(Exception):
    """The request was cancelled (its client went away); nothing more is generated for it."""


class QueueFullError(Exception):
    """The wait queue is at its bound; retry later."""


@dataclass(eq=False)
class Request:
    """One generation request and its progress through the engine."""

    token_ids: list[int]  # the prompt, validated (Engine.encode)
    params: SamplingParams
    cache_salt: str = ""
    tenant: str | None = None  # quota and fairness group; None: no API key
    on_token: TokenCallback | None = None
    future: Future = field(default_factory=Future)
    arrival: float = field(default_factory=time.perf_counter)
    scheduled: float | None = None  # first admitted into a step
    first_token: float | None = None
    cancelled: bool = False
    displaced: bool = False  # refused from a full queue to let a tenant with fewer in
    output: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the cache (first admission)
    expected_cached_tokens: int = 0  # the device pool's prefix when queued (the load it reports)
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    num_load_retries: int = 0  # admissions whose tier blocks did not verify (then: whole loads)
    sampler: Sampler | None = None
    state: Any = None  # the engine's per-request state while admitted
    # lookup keys of the full blocks of its tokens (prompt, then output once preempted):
    # hashed once when admitted, extended as tokens come; peek, lookup and commit reuse them
    keys: list[bytes] = field(default_factory=list)
    key_set: Any = None  # the scheduler's set of `keys` while waiting
    logprobs: Any = None  # what it gathered when its params ask (logprobs.RequestLogprobs)
    # called before the future resolves (the server's metrics of the request)
    on_done: Callable[[Request, GenerateResult | None], None] | None = None
    group: Any = None  # its SequenceGroup when one of a prompt's n sequences (loop/group.py)
    # sum of log_softmax(logits)[token] over its output tokens; None: not counted (best_of)
    cumulative_logprob: float | None = None
    retention: tuple[Retain, ...] = ()  # retained once its prompt is prefilled
    # a token sampled on the device and not yet on the host (engine/loop/overlap.py): its
    # slot in the device's sampled tokens
    num_pending: int = 0
    pending_slot: int | None = None
    # a hand-over's (engine/server/handover.py): the prompt tokens cached before its prefill
    # replica computed the rest, which is what its usage reports
    handed_over: int | None = None

    def reported_cached(self, loaded: int) -> int:
        """The cached tokens its answer reports when `loaded` came from the cache: a
        hand-over reports what one replica would have, not what its prefill replica wrote."""
        return loaded if self.handed_over is None else min(loaded, self.handed_over)

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V the request needs: prompt, output so far and a pending token."""
        return len(self.token_ids) + len(self.output) + self.num_pending

    def token_slice(self, start: int, end: int) -> list[int]:
        """(prompt + output)[start:end], without building the whole list."""
        n = len(self.token_ids)
        if end <= n:
            return self.token_ids[start:end]
        if start >= n:
            return self.output[start - n : end - n]
        return self.token_ids[start:] + self.output[: end - n]

    @property
    def queue_wait_s(self) -> float | None:
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def ttft_s(self) -> float | None:
        """From arrival to the first generated token, queueing included."""
        return None if self.first_token is None else self.first_token - self.arrival

    def emit(self, token_id: int) -> None:
        """Record a sampled token and hand it to the callback; a cancelled request raises."""
        if self.cancelled:
            raise RequestCancelled("the client went away")
        if self.first_token is None:
            self.first_token = time.perf_counter()
        self.output.append(token_id)
        if self.on_token is not None:
            self.on_token(token_id)
