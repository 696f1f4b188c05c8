"""The reference engine: lookup, load the cached prefix, prefill the suffix, decode, store.

One worker thread runs requests one at a time from a thread-safe queue; `run` is the
synchronous path it uses. The cached prefix's K/V goes into a transformers `DynamicCache`
and the suffix is prefilled with explicit position ids continuing from the cached length
(transformers builds an explicit causal mask whenever the query is shorter than the keys).
"""

from __future__ import annotations

import functools
import inspect
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from transformers import DynamicCache

from engine.model import LoadedModel
from hashing import validate_salt
from kvstore.cache import KVPrefix, PrefixCache
from kvstore.config import CacheConfig

Prompt = str | Sequence[int]
TokenCallback = Callable[[int], None]


def _ignore(token_id: int) -> None:
    """The default token callback."""


def _since(start: float) -> float:
    return time.perf_counter() - start


class InvalidRequestError(ValueError):
    """A request is malformed; the message says what to fix."""


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

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise InvalidRequestError(f"max_new_tokens must be an int >= 1, got {n!r}")
        if not isinstance(self.temperature, int | float) or not 0 <= self.temperature <= 100:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not -(2**63) <= self.seed < 2**64  # what torch.Generator.manual_seed takes
        ):
            raise InvalidRequestError(f"seed must be a 64-bit int or None, got {self.seed!r}")
        object.__setattr__(
            self, "stop_token_ids", _int_tuple("stop_token_ids", self.stop_token_ids)
        )
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidRequestError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)


class GenerateResult(NamedTuple):
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was loaded from the cache
    output_token_ids: list[int]
    text: str
    ttft_s: float  # lookup + load + suffix prefill + first token
    finish_reason: str  # "stop" or "length"
    cached_by_tier: dict[str, int]  # cached tokens by source tier ("device", "lmdb", ...)
    queue_s: float  # time from submit until the worker started the request


class Prefill(NamedTuple):
    logits: torch.Tensor  # [vocab] float32, last prompt position
    cached_tokens: int
    past: DynamicCache  # KV of every prompt token
    cached_by_tier: dict[str, int]


class _Sampler:
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


@functools.cache
def _last_logits_only(model_cls: type) -> dict[str, int]:
    """Forward kwargs that compute logits for the last position only, where supported."""
    params = inspect.signature(model_cls.forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def forward_on(model: torch.nn.Module, ids: Sequence[int], past: DynamicCache) -> torch.Tensor:
    """Run `ids` on top of `past` (positions continue from its length, so a suffix after a
    cached prefix is placed right); the last position's logits, [vocab] float32."""
    device, start = model.device, past.get_seq_length()
    out = model(
        input_ids=torch.tensor([list(ids)], dtype=torch.long, device=device),
        position_ids=torch.arange(start, start + len(ids), device=device).unsqueeze(0),
        past_key_values=past,
        use_cache=True,
        **_last_logits_only(type(model)),
    )
    return out.logits[0, -1].float()


def past_from_prefix(config: object, kv: KVPrefix, device: torch.device) -> DynamicCache:
    """A DynamicCache holding the prefix K/V (no extra copy when already on `device`)."""
    past = DynamicCache(config=config)
    if kv.num_tokens == 0:
        return past
    if len(kv.layers) != len(past.layers):
        raise ValueError(f"prefix has {len(kv.layers)} layers, the model {len(past.layers)}")
    for layer, (k, v) in zip(past.layers, kv.layers, strict=True):
        k, v = k[:, :, : kv.num_tokens].to(device), v[:, :, : kv.num_tokens].to(device)
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return past


class Engine:
    """Generates with prefix caching through one `PrefixCache` for the model's namespace."""

    def __init__(self, model: LoadedModel, cache_config: CacheConfig, cache_generated: bool = True):
        self.model = model
        self.cache_config = cache_config
        self.cache_generated = cache_generated
        namespace = model.namespace(
            cache_config.block_size, cache_config.tenant_salt, cache_config.codec
        )
        self.cache = PrefixCache(cache_config, namespace)
        self._lock = threading.Lock()  # one forward pass at a time
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._queue_lock = threading.Lock()
        self._closed = False
        self._worker = threading.Thread(target=self._serve, name="kvstore-engine", daemon=True)
        self._worker.start()

    # --- requests -------------------------------------------------------------------------

    def encode(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Validated token ids of a prompt (text is tokenized with the model's tokenizer)."""
        if isinstance(prompt, str):
            ids = self.model.tokenizer(prompt)["input_ids"] if prompt else []
        elif isinstance(prompt, Sequence | torch.Tensor | np.ndarray):
            ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
            ids = [int(t) if isinstance(t, np.integer) else t for t in ids]
        else:
            raise InvalidRequestError(f"a prompt is a str or a list of token ids, got {prompt!r}")
        if not ids:
            raise InvalidRequestError("prompt is empty; give at least one token")
        vocab = self.model.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"token ids must be ints in [0, {vocab})")
        limit = self.model.max_positions
        if limit is not None and len(ids) + params.max_new_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the model's {limit} positions; shorten the prompt or lower max_new_tokens"
            )
        return ids

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str = "",
        on_token: TokenCallback | None = None,
        tenant: str = "",
    ) -> Future:
        """Queue one request; the future resolves to a `GenerateResult`.

        `cache_salt` narrows cache sharing to requests with the same salt. `on_token(id)` is
        called from the worker thread for each generated token, as soon as it is sampled; an
        exception it raises cancels the request (the future gets it, nothing is stored).
        Device blocks the request adds count against `tenant`'s quota (tenant_quota_blocks).
        """
        params = params or SamplingParams()
        return self._enqueue(self.encode(prompt, params), params, cache_salt, on_token, tenant)

    def generate(
        self,
        prompts: str | Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        cache_salt: str = "",
    ) -> list[GenerateResult]:
        """Generate for each prompt (a str or a list of token ids); thread-safe."""
        params = params or SamplingParams()
        if isinstance(prompts, str):
            prompts = [prompts]
        if any(isinstance(p, int) for p in prompts):
            raise InvalidRequestError("prompts is a list of prompts; wrap token ids in a list")
        all_ids = [self.encode(prompt, params) for prompt in prompts]  # all valid before queueing
        futures = [self._enqueue(ids, params, cache_salt) for ids in all_ids]
        return [f.result() for f in futures]

    def _enqueue(
        self,
        ids: list[int],
        params: SamplingParams,
        cache_salt: str = "",
        on_token: TokenCallback | None = None,
        tenant: str = "",
    ) -> Future:
        try:
            validate_salt(cache_salt)
        except ValueError as e:
            raise InvalidRequestError(f"cache_salt: {e}") from None
        future: Future = Future()
        item = (ids, params, cache_salt, on_token, tenant, future, time.perf_counter())
        with self._queue_lock:  # nothing may follow the stop sentinel
            if self._closed:
                raise EngineClosedError("engine is closed")
            self._queue.put(item)
        return future

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            ids, params, salt, on_token, tenant, future, enqueued = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                queue_s = _since(enqueued)
                result = self.run(ids, params, salt, on_token, tenant)
                future.set_result(result._replace(queue_s=queue_s))
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

    # --- the synchronous path ---------------------------------------------------------------

    def run(
        self,
        token_ids: list[int],
        params: SamplingParams,
        cache_salt: str = "",
        on_token: TokenCallback | None = None,
        tenant: str = "",
    ) -> GenerateResult:
        """One request, synchronously (validated token ids)."""
        sampler = _Sampler(params)
        emit = on_token or _ignore
        with self._lock, torch.inference_mode():
            start = time.perf_counter()
            pre = self._prefill(token_ids, cache_salt, tenant)
            output = [sampler(pre.logits)]
            ttft = _since(start)
            emit(output[0])
            reason, text = self._decode(pre.past, output, params, sampler, emit)
            self._store(token_ids, output, pre.past, cache_salt, tenant)
        return GenerateResult(
            len(token_ids), pre.cached_tokens, output, text, ttft, reason, pre.cached_by_tier, 0.0
        )

    def prefill(self, token_ids: list[int], cache_salt: str = "") -> Prefill:
        """Lookup, load and suffix prefill of validated token ids; stores nothing."""
        with self._lock, torch.inference_mode():
            return self._prefill(token_ids, cache_salt)

    def prefill_logits(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Last-position logits ([vocab], float32) and cached_tokens; stores the prompt's blocks."""
        ids = self.encode(list(token_ids), SamplingParams(max_new_tokens=1))
        pre = self.prefill(ids)
        with self._lock, torch.inference_mode():
            self._store(ids, [], pre.past)
        return pre.logits, pre.cached_tokens

    def _forward(self, ids: list[int], past: DynamicCache) -> torch.Tensor:
        return forward_on(self.model.model, ids, past)

    def _prefill(self, token_ids: list[int], cache_salt: str, tenant: str = "") -> Prefill:
        hit = self.cache.lookup(token_ids, salt=cache_salt, owner=tenant)
        try:
            kv = self.cache.load(hit)
        finally:
            self.cache.release(hit)
        past = past_from_prefix(self.model.model.config, kv, self.model.device)
        logits = self._forward(token_ids[kv.num_tokens :], past)
        return Prefill(logits, kv.num_tokens, past, hit.tier_tokens)

    def _decode(
        self,
        past: DynamicCache,
        output: list[int],
        params: SamplingParams,
        sampler: _Sampler,
        emit: TokenCallback,
    ) -> tuple[str, str]:
        """Extend `output` in place until a stop; returns (finish_reason, text)."""
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.model.eos_token_ids)
        decode = self.model.tokenizer.decode
        while True:
            if params.stop:  # stop strings need the text so far; otherwise decode once at the end
                text = decode(output, skip_special_tokens=True)
                cut = min((i for s in params.stop if (i := text.find(s)) >= 0), default=None)
                if cut is not None:
                    return "stop", text[:cut]
            if output[-1] in stop_ids:
                return "stop", decode(output, skip_special_tokens=True)
            if len(output) >= params.max_new_tokens:
                return "length", decode(output, skip_special_tokens=True)
            output.append(sampler(self._forward(output[-1:], past)))
            emit(output[-1])

    def _store(
        self,
        prompt: list[int],
        output: list[int],
        past: DynamicCache,
        cache_salt: str = "",
        tenant: str = "",
    ) -> int:
        """Store new full blocks: the prompt, plus generated tokens when cache_generated."""
        ids = prompt + output if self.cache_generated else prompt
        n = min(len(ids), past.get_seq_length())  # the last generated token has no KV
        layers = [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in past.layers]
        return self.cache.store(ids[:n], layers, salt=cache_salt, owner=tenant)

    # --- lifecycle ----------------------------------------------------------------------------

    def stats(self) -> dict:
        return self.cache.stats()

    def close(self) -> None:
        """Finish queued requests, stop the worker and close the cache. Idempotent."""
        with self._queue_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._worker.join()
        self.cache.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reference_generate(
    model: LoadedModel, token_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()
) -> tuple[list[int], float]:
    """Greedy tokens without kvstore (full prefill, then a plain decode loop) and its TTFT."""
    lm, device = model.model, model.device
    with torch.inference_mode():
        start = time.perf_counter()
        past = DynamicCache(config=lm.config)
        out = lm(input_ids=torch.tensor([list(token_ids)], device=device), past_key_values=past)
        tokens = [int(torch.argmax(out.logits[0, -1]))]
        ttft = time.perf_counter() - start
        while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
            out = lm(input_ids=torch.tensor([tokens[-1:]], device=device), past_key_values=past)
            tokens.append(int(torch.argmax(out.logits[0, -1])))
    return tokens, ttft
