"""One threading choice's step times, in a process of its own (`python -m bench contention`
starts it, with libgomp's environment set): loads the model, prints `ready`, then measures
once per line it reads on stdin (the parent makes the cores quiet or busy between them) and
prints each measurement as one JSON line, until stdin closes.

prefill_s: the TTFT of one `--prompt-tokens` prompt (a prompt of its own each time: the
whole prompt is prefilled); decode_step_s: the time per decode step of `--decode-batch`
requests decoding `--decode-tokens` tokens each, after their prefill (their first token)."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from engine.commands import quiet_load_model, threads_flag
from engine.loop.engine import Engine
from engine.loop.request import SamplingParams
from engine.loop.threads import ThreadConfig
from kvstore.config import CacheConfig


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def measure(engine: Engine, args: argparse.Namespace, vocab: int, seed: int) -> dict:
    """A warm-up request, then one prefill and one decode batch timed, on prompts no earlier
    measurement cached: the warm-up runs in the cores' present state (quiet or busy), as a
    fresh process's would, so an adaptive thread count has seen it before the timing."""
    short = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine.generate(prompts(1, 64, vocab, seed), short)
    first = engine.generate(prompts(1, args.prompt_tokens, vocab, seed + 1), short)[0]
    decode = SamplingParams(max_new_tokens=args.decode_tokens, ignore_eos=True)
    batch = prompts(args.decode_batch, 32, vocab, seed + 2)
    start = time.perf_counter()
    results = engine.generate(batch, decode)
    after_first = time.perf_counter() - start - max(r.ttft_s for r in results)
    return {
        "prefill_s": first.ttft_s,
        "decode_step_s": after_first / (args.decode_tokens - 1),
        "threads_at_end": engine.governor.threads if engine.governor else None,
    }


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
        print("ready", flush=True)
        for seed, _ in enumerate(sys.stdin):
            print(json.dumps(measure(engine, args, vocab, 3 * seed)), flush=True)


if __name__ == "__main__":
    main()
