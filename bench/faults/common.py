"""The shared parts of the fault scenarios: the micro model, the no-cache reference
check, request helpers and client threads; the private redis-server the scenarios may pause,
kill and restart is a `bench.launch.RedisServer`."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import redis

from bench.launch import RedisServer
from engine.contract import FP32_TOL, greedy_matches_reference
from engine.loop.engine import Engine, GenerateResult, SamplingParams
from engine.model.loading import (
    LoadedModel,
    byte_tokenizer,
    random_model,
    wrap_model,
)
from engine.model.tiny import micro_config
from hashing import KEY_ID_BYTES
from kvstore.config import CODEC_TOLERANCE, POOL_CODECS, CacheConfig
from kvstore.entry import FIXED_HEADER_BYTES, ID_BYTES

BS = 4
PARAMS = SamplingParams(max_new_tokens=4)
PROMPT_LEN = 10 * BS + 1  # 10 whole blocks can hit, the last token is always computed
NAMESPACE_AT = FIXED_HEADER_BYTES - 4 * ID_BYTES  # namespace, key, digest, parent end the header
KEY_ID_AT = NAMESPACE_AT - KEY_ID_BYTES  # the secret's key id comes before them


@dataclass(frozen=True)
class Scale:
    requests: int  # per load scenario
    collision_trials: int
    leak_requests: int
    outage_s: float  # length of each Redis pause / downtime
    kill_rounds: int = 5  # writer processes SIGKILLed
    load_clients: int = 8  # streaming clients of the concurrent family
    load_requests: int = 24  # requests per concurrent scenario (after its baseline)


SCALES = {
    "ci": Scale(requests=24, collision_trials=300, leak_requests=300, outage_s=0.6),
    "full": Scale(
        requests=120,
        collision_trials=10_000,
        leak_requests=10_000,
        outage_s=2.0,
        kill_rounds=100,
        load_clients=16,
        load_requests=96,
    ),
}


@dataclass
class FaultOutcome:
    name: str
    injected: str  # how the fault was injected
    requests: int
    succeeded: int
    wrong_outputs: int  # vs the no-cache reference, beyond the contract's tolerance
    lost_entries: int  # acknowledged writes missing with no eviction/verification to explain
    corrupt_injected: int
    corrupt_detected: int
    recovery_s: float | None = None
    note: str = ""
    figures: dict[str, float] = field(default_factory=dict)  # scenario-specific counts


class Context(NamedTuple):
    model: LoadedModel
    redis: RedisServer  # private: the scenarios may pause, kill and restart it
    workdir: Path
    scale: Scale
    codec: str = "none"  # the tier entries' (in-process scenarios: CODEC_SCENARIOS)
    kv_cache_dtype: str = "auto"  # the device pool's (the same scenarios)

    @property
    def lossy(self) -> str:
        """The codec whose tolerance outputs are held to: a quantized pool's, else `codec`."""
        return POOL_CODECS.get(self.kv_cache_dtype, self.codec)


# ----------------------------------------------------------------------------- the model


def micro_model(seed: int = 1) -> LoadedModel:
    config = micro_config()
    return wrap_model(random_model(config, seed), byte_tokenizer(), f"micro-{seed}")


def cache_config(ctx: Context, **overrides: object) -> CacheConfig:
    values = {"block_size": BS, "device": "cpu", "device_blocks": 256, "codec": ctx.codec,
              "kv_cache_dtype": ctx.kv_cache_dtype, **overrides}  # fmt: skip
    values.setdefault("lookup_deadline_ms", 100.0)
    return CacheConfig(**values)


def make_prompts(n: int, seed: int, length: int = PROMPT_LEN) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length).tolist() for _ in range(n)]


def serve(
    engine: Engine, prompts: list[list[int]], salt: str = "", params: SamplingParams = PARAMS
) -> list[GenerateResult | None]:
    """One request per prompt; a failed request is None (counted, never raised)."""
    results: list[GenerateResult | None] = []
    for prompt in prompts:
        try:
            results.append(engine.generate([prompt], params, cache_salt=salt)[0])
        except Exception:
            results.append(None)
    return results


def count_wrong(
    model: LoadedModel, prompts: list[list[int]], results: list, codec: str = "none"
) -> int:
    """Outputs off the no-cache reference beyond the contract: the codec's tolerance
    (CODEC_TOLERANCE; a lossy codec's tier hits are bounded, not exact)."""
    tol = max(FP32_TOL, CODEC_TOLERANCE[codec])
    return sum(
        r is not None and not greedy_matches_reference(model, p, r.output_token_ids, tol)
        for p, r in zip(prompts, results, strict=True)
    )


def outcome(
    ctx: Context, name: str, injected: str, prompts: list, results: list, **kw: object
) -> FaultOutcome:
    values = {"lost_entries": 0, "corrupt_injected": 0, "corrupt_detected": 0, **kw}
    ok = sum(r is not None for r in results)
    wrong = count_wrong(ctx.model, prompts, results, ctx.lossy)
    wrong += int(values.pop("wrong_outputs_extra", 0))
    return FaultOutcome(  # type: ignore[arg-type]
        name=name,
        injected=injected,
        requests=len(prompts),
        succeeded=ok,
        wrong_outputs=wrong,
        **values,
    )


def flush_redis(url: str) -> None:
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        client.flushall()


def tier_config(ctx: Context, tier: str, tag: str, **kw: object) -> CacheConfig:
    if tier == "lmdb":
        return cache_config(ctx, lmdb_dir=str(ctx.workdir / f"lmdb-{tag}"), **kw)
    return cache_config(ctx, redis_url=ctx.redis.url, **kw)


class Timed(NamedTuple):
    done_at: float  # perf_counter when the request finished
    prompt: list[int]
    result: GenerateResult | None


def load_threads(
    engine: Engine,
    prompts: list[list[int]],
    stop: threading.Event,
    out: list[Timed],
    errors: list[str],
    n: int = 4,
) -> list[threading.Thread]:
    """`n` client threads submitting random prompts to one engine until `stop`."""

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            prompt = rng.choice(prompts)
            try:
                result = engine.submit(prompt, PARAMS).result()
            except Exception as e:
                result = None
                errors.append(f"{type(e).__name__}: {e}")
            out.append(Timed(time.perf_counter(), prompt, result))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()
