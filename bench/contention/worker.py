"""One threading choice's step times, in a process of its own (`python -m bench contention`
starts it, with libgomp's environment set): prints one JSON line.

prefill_s: the TTFT of one `--prompt-tokens` prompt (a cold cache: the whole prompt is
prefilled); decode_step_s: the time per decode step of `--decode-batch` requests decoding
`--decode-tokens` tokens each, after their prefill (their first token)."""

from __future__ import annotations

import argparse
import json
import random
import time

from engine.commands import quiet_load_model, threads_flag
from engine.loop.engine import Engine
from engine.loop.request import SamplingParams
from engine.loop.threads import ThreadConfig
from kvstore.config import CacheConfig


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--threads", type=threads_flag, default=None)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-batch", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=32)
    args = p.parse_args()
    model = quiet_load_model(args.model, "cpu")
    vocab = len(model.tokenizer)
    threads = ThreadConfig(threads=args.threads, adapt=args.threads is None)
    with Engine(model, CacheConfig(device_blocks=1024), thread_config=threads) as engine:
        warm = SamplingParams(max_new_tokens=2, ignore_eos=True)
        engine.generate(prompts(1, 64, vocab, 0), warm)
        first = engine.generate(prompts(1, args.prompt_tokens, vocab, 1), warm)[0]
        decode = SamplingParams(max_new_tokens=args.decode_tokens, ignore_eos=True)
        batch = prompts(args.decode_batch, 32, vocab, 2)
        start = time.perf_counter()
        results = engine.generate(batch, decode)
        wall = time.perf_counter() - start
    after_first = wall - max(r.ttft_s for r in results)
    print(json.dumps({
        "prefill_s": first.ttft_s,
        "decode_step_s": after_first / (args.decode_tokens - 1),
        "threads_at_end": engine.governor.threads if engine.governor else None,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
