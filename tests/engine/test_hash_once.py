"""A request's block keys are hashed once, when it is added: peek, the scheduler's
probes, the lookup and the commits reuse them. Counted from the outside, as xxh3 digests."""

from __future__ import annotations

import random

import pytest
import xxhash
from engine_helpers import BLOCK_SIZE, micro_cache_config

from engine.loop.engine import Engine, SamplingParams
from engine.model.loading import LoadedModel

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
