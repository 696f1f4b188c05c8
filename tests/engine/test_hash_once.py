"""A request's block keys are hashed once, when it is added: peek, the scheduler's
probes, the lookup and the commits reuse them. Counted from the outside, as xxh3 digests."""

from __future__ import annotations

import random
import time

import pytest
import xxhash
from engine_helpers import BLOCK_SIZE, micro_cache_config

from engine.loop.engine import Engine, SamplingParams
from engine.loop.request import Request
from engine.loop.scheduler_config import SchedulerConfig
from engine.model.loading import LoadedModel, load_model
from kvstore.config import CacheConfig

NUM_BLOCKS = 60  # 240 prompt tokens of the micro model's 256 positions


class Digests:
    """Counts xxh3-128 digests: the block hasher's and any other xxh3_128 user's (tails)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        digest, hasher = xxhash.xxh3_128_digest, xxhash.xxh3_128

        def counted_digest(*args: object, **kwargs: object) -> bytes:
            self.count += 1
            return digest(*args, **kwargs)

        def counted_hasher(*args: object, **kwargs: object) -> object:
            self.count += 1
            return hasher(*args, **kwargs)

        monkeypatch.setattr(xxhash, "xxh3_128_digest", counted_digest)
        monkeypatch.setattr(xxhash, "xxh3_128", counted_hasher)

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def prompt(seed: int, shared: list[int] | None = None) -> list[int]:
    rng = random.Random(seed)
    head = shared or []
    return head + [rng.randrange(256) for _ in range(NUM_BLOCKS * BLOCK_SIZE - len(head))]


@pytest.mark.parametrize("tail_blocks", [0, None])
def test_an_admitted_request_is_hashed_about_once(
    micro: LoadedModel, monkeypatch: pytest.MonkeyPatch, tail_blocks: int | None
) -> None:
    params = SamplingParams(max_new_tokens=8)
    bound = 1.25 * NUM_BLOCKS + 8
    with Engine(micro, micro_cache_config(tail_blocks=tail_blocks)) as engine:
        engine.generate([[1, 2, 3, 4, 5]], params)  # the engine's first-step work, uncounted
        digests = Digests(monkeypatch)
        first = prompt(seed=1)
        (cold,) = engine.generate([first], params)
        cold_digests = digests.take()
        (warm,) = engine.generate([first[: 40 * BLOCK_SIZE] + prompt(seed=2)[:80]], params)
        warm_digests = digests.take()
    assert cold.cached_tokens == 0 and warm.cached_tokens == 40 * BLOCK_SIZE
    # every prompt block, then the output's new full blocks (8 tokens: 2 blocks)
    assert NUM_BLOCKS <= cold_digests <= bound, cold_digests
    assert NUM_BLOCKS <= warm_digests <= bound, warm_digests


# A 2,048-token prompt on `tiny` (16-token blocks: 128 of them), however it is prefilled
LONG_BLOCKS = 128
LONG_BOUND = 1.25 * LONG_BLOCKS + 8
ONE = SamplingParams(max_new_tokens=1)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def long_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(LONG_BLOCKS * 16)]


def tiny_engine(tiny: LoadedModel, chunk: int = 256) -> Engine:
    steps = SchedulerConfig(max_num_batched_tokens=chunk)
    engine = Engine(tiny, CacheConfig(block_size=16, device_blocks=400), scheduler_config=steps)
    engine.generate([[1, 2, 3]], ONE)  # the engine's first-step work, uncounted
    return engine


@pytest.mark.parametrize("chunk", [512, 256, 128], ids=["4-chunks", "8-chunks", "16-chunks"])
def test_a_long_prompt_is_hashed_once_however_it_is_chunked(tiny, monkeypatch, chunk) -> None:
    with tiny_engine(tiny, chunk) as engine:
        digests = Digests(monkeypatch)
        (result,) = engine.generate([long_prompt(1)], ONE)
        count = digests.take()
    assert result.prompt_tokens == 2048
    assert LONG_BLOCKS <= count <= LONG_BOUND, count


def test_the_synchronous_path_hashes_a_long_prompt_once(tiny, monkeypatch) -> None:
    with tiny_engine(tiny) as engine:
        digests = Digests(monkeypatch)
        engine.run(long_prompt(2), ONE)
        count = digests.take()
    assert LONG_BLOCKS <= count <= LONG_BOUND, count


def test_the_server_hashes_a_long_prompt_once(tiny, monkeypatch) -> None:
    from starlette.testclient import TestClient

    from engine.server.app import create_app
    from engine.server.config import ServerConfig

    with tiny_engine(tiny) as engine, TestClient(create_app(engine, ServerConfig())) as client:
        digests = Digests(monkeypatch)
        body = {"model": "tiny", "prompt": long_prompt(3), "max_tokens": 1}
        answer = client.post("/v1/completions", json=body)
        count = digests.take()
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == 2048
    assert LONG_BLOCKS <= count <= LONG_BOUND, count


def test_a_preempted_request_resumes_without_hashing_its_prompt_again(tiny, monkeypatch) -> None:
    with tiny_engine(tiny, chunk=128) as engine:
        digests = Digests(monkeypatch)
        request = Request(long_prompt(4), ONE)
        engine.add_requests([request])
        while request.state is None or request.state.num_computed < 512:
            time.sleep(0.005)
        engine.on_loop(lambda: engine.scheduler.preempt(request))
        result = request.future.result(120)
        count = digests.take()
    assert request.num_preemptions == 1 and result.prompt_tokens == 2048
    assert LONG_BLOCKS <= count <= LONG_BOUND, count
