"""The per-request path on a transformers `DynamicCache`: lookup, load the cached prefix
(gathered out of the pool), prefill the suffix, decode, store (scattered back).

It serves models the paged attention hook cannot (the engine then runs one request at a time)
and the synchronous `Engine.prefill` that `bench ttft` times. The suffix is prefilled with
explicit position ids continuing from the cached length.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from transformers import DynamicCache

from engine.loop.group import sampler_of
from engine.loop.request import (
    GenerateResult,
    Request,
    RequestCancelled,
    Sampler,
    SamplingParams,
    StopChecker,
    TokenCallback,
)
from engine.loop.retain import retain_prompt
from engine.model.loading import LoadedModel, kv_cache, with_cache
from kvstore.cache import KVPrefix, PrefixCache

if TYPE_CHECKING:
    from engine.loop.outcomes import Outcomes


class Prefill(NamedTuple):
    logits: torch.Tensor  # [vocab] float32, last prompt position
    cached_tokens: int
    past: DynamicCache  # KV of every prompt token
    cached_by_tier: dict[str, int]
    keys: list[bytes]  # the lookup's block keys: storing continues their chain


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
        use_cache=True,
        **with_cache(model, past),
        **_last_logits_only(type(model)),
    )
    return out.logits[0, -1].float()


def past_from_prefix(config: object, kv: KVPrefix, device: torch.device) -> DynamicCache:
    """A DynamicCache holding the prefix K/V (no extra copy when already on `device`)."""
    past = kv_cache(config)
    if kv.num_tokens == 0:
        return past
    if len(kv.layers) != len(past.layers):
        raise ValueError(f"prefix has {len(kv.layers)} layers, the model {len(past.layers)}")
    for layer, (k, v) in zip(past.layers, kv.layers, strict=True):
        k, v = k[:, :, : kv.num_tokens].to(device), v[:, :, : kv.num_tokens].to(device)
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return past


def _ignore(token_id: int) -> None:
    """The default token callback."""


class SequentialPath:
    """One request at a time through a DynamicCache; the caller serializes calls."""

    def __init__(self, model: LoadedModel, cache: PrefixCache, cache_generated: bool = True):
        self.model = model
        self.cache = cache
        self.cache_generated = cache_generated

    def run(
        self,
        token_ids: list[int],
        params: SamplingParams,
        cache_salt: str = "",
        on_token: TokenCallback | None = None,
        tenant: str = "",
        sampler: Sampler | None = None,
    ) -> GenerateResult:
        """One request, synchronously (validated token ids)."""
        sampler = sampler or Sampler(params)
        emit = on_token or _ignore
        with torch.inference_mode():
            start = time.perf_counter()
            pre = self.prefill(token_ids, cache_salt, tenant)
            output = [sampler(pre.logits)]
            ttft = time.perf_counter() - start
            emit(output[0])
            reason, text = self._decode(pre.past, output, params, sampler, emit)
            self.store(token_ids, output, pre, cache_salt, tenant)
        return GenerateResult(
            prompt_tokens=len(token_ids),
            cached_tokens=pre.cached_tokens,
            output_token_ids=output,
            text=text,
            ttft_s=ttft,
            finish_reason=reason,
            cached_by_tier=pre.cached_by_tier,
            queue_s=0.0,
        )

    def serve(self, request: Request, outcomes: Outcomes, lock: threading.Lock) -> None:
        """The fallback's step: `request` (taken from the queue) runs alone, start to finish,
        under the engine's forward `lock`; `outcomes` resolves it."""
        if request.cancelled or not outcomes.started(request):
            outcomes.fail(request, RequestCancelled("cancelled while waiting"))
            return
        try:
            with lock:
                result = self.run(
                    request.token_ids, request.params, request.cache_salt, request.emit,
                    request.tenant or "", sampler_of(request),
                )  # fmt: skip
                retain_prompt(self.cache, request)
        except BaseException as e:
            outcomes.fail(request, e)
            return
        request.num_cached_tokens = result.cached_tokens
        cached = request.reported_cached(result.cached_tokens)
        result = result._replace(queue_s=request.scheduled - request.arrival, cached_tokens=cached)
        outcomes.done(request, result)
        request.future.set_result(result)

    def _forward(self, ids: list[int], past: DynamicCache) -> torch.Tensor:
        return forward_on(self.model.model, ids, past)

    def prefill(self, token_ids: list[int], cache_salt: str = "", tenant: str = "") -> Prefill:
        """Lookup, load and suffix prefill of validated token ids; stores nothing."""
        hit = self.cache.lookup(token_ids, cache_salt=cache_salt, tenant=tenant)
        try:
            kv = self.cache.load(hit)
        finally:
            self.cache.release(hit)
        past = past_from_prefix(self.model.model.config, kv, self.model.device)
        logits = self._forward(token_ids[kv.num_tokens :], past)
        return Prefill(
            logits=logits,
            cached_tokens=kv.num_tokens,
            past=past,
            cached_by_tier=hit.tier_tokens,
            keys=hit.keys,
        )

    def _decode(
        self,
        past: DynamicCache,
        output: list[int],
        params: SamplingParams,
        sampler: Sampler,
        emit: TokenCallback,
    ) -> tuple[str, str]:
        """Extend `output` in place until a stop; returns (finish_reason, text)."""
        stop = StopChecker(params, self.model.eos_token_ids, self.model.tokenizer)
        while (done := stop(output)) is None:
            output.append(sampler(self._forward(output[-1:], past)))
            emit(output[-1])
        return done

    def store(
        self,
        prompt: list[int],
        output: list[int],
        pre: Prefill,
        cache_salt: str = "",
        tenant: str = "",
    ) -> int:
        """Store new full blocks: the prompt, plus generated tokens when cache_generated."""
        ids = prompt + output if self.cache_generated else prompt
        n = min(len(ids), pre.past.get_seq_length())  # the last generated token has no KV
        layers = [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in pre.past.layers]
        return self.cache.store(ids[:n], layers, cache_salt, tenant, pre.keys)


def reference_generate(
    model: LoadedModel, token_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()
) -> tuple[list[int], float]:
    """Greedy tokens without kvstore (full prefill, then a plain decode loop) and its TTFT."""
    lm, device = model.model, model.device
    with torch.inference_mode():
        start = time.perf_counter()
        past = DynamicCache(config=lm.config)
        out = lm(input_ids=torch.tensor([list(token_ids)], device=device), **with_cache(lm, past))
        tokens = [int(torch.argmax(out.logits[0, -1]))]
        ttft = time.perf_counter() - start
        while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
            out = lm(input_ids=torch.tensor([tokens[-1:]], device=device), **with_cache(lm, past))
            tokens.append(int(torch.argmax(out.logits[0, -1])))
    return tokens, ttft
