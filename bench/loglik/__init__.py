"""`python -m bench loglik`: a harness-like loglikelihood workload (multiple choice as
lm-eval-harness scores it), with the prefix cache and without.

`--questions` questions (50) share one `--context`-token context (400: a few-shot prompt),
each with `--choices` answers (4); every request is context + question + choice and asks
for the prompt tokens' logprobs only (`SamplingParams(max_new_tokens=1, prompt_logprobs=1)`:
what the server runs for `echo=true, logprobs=1, max_tokens=0`). Random token ids (tiny's
byte vocabulary); all requests are queued at once, as a harness sends a batch. About 40 s
on tiny on a 2-core CPU, most of it the no-cache arm.

Two arms, each on a fresh engine in this process: `cached` (the default: a block's prompt
logprobs are kept beside its K/V, so a request hits every block of the shared context that
an earlier request computed), and `no-cache` (`prompt_logprob_blocks=0`: no summaries, so
each request prefills its whole prompt, as without a prefix cache). Per arm: wall and CPU
time, prompt tokens, uncached (prefilled) tokens and the worst difference of any prompt
logprob between the arms (the summaries are exact: within the output contract's
tolerance). Wall time moves with other jobs on a shared machine; the process's CPU time
much less.
"""

from __future__ import annotations

import argparse
import time
from typing import NamedTuple

import numpy as np

from engine.commands import check_cache_config, quiet_load_model
from engine.loop.engine import Engine
from engine.loop.request import GenerateResult, Request, SamplingParams
from kvstore.config import CacheConfig

PARAMS = SamplingParams(max_new_tokens=1, prompt_logprobs=1)


class Arm(NamedTuple):
    name: str
    wall_s: float
    cpu_s: float  # the process's CPU time: less moved by other jobs on a shared machine
    prompt_tokens: int
    uncached_tokens: int
    logprobs: list[list[float | None]]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench loglik", description=__doc__)
    parser.add_argument("--model", default="tiny", help="tiny (default), smollm2, a directory")
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--context", type=int, default=400, help="shared context tokens")
    parser.add_argument("--question-tokens", type=int, default=24)
    parser.add_argument("--choice-tokens", type=int, default=6)
    parser.add_argument("--device", default="auto", help="where the pool and the model go")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """context + question + choice, for each question and choice (seeded)."""
    rng = np.random.default_rng(args.seed)
    draw = lambda n: rng.integers(0, min(vocab, 256), n).tolist()  # noqa: E731
    context = draw(args.context)
    prompts = []
    for _ in range(args.questions):
        question = draw(args.question_tokens)
        prompts += [context + question + draw(args.choice_tokens) for _ in range(args.choices)]
    return prompts


def run_arm(name: str, engine: Engine, prompts: list[list[int]]) -> Arm:
    start, cpu = time.perf_counter(), time.process_time()
    requests = engine.add_requests([Request(p, PARAMS) for p in prompts])
    results: list[GenerateResult] = [r.future.result() for r in requests]
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    total = sum(r.prompt_tokens for r in results)
    uncached = sum(r.prompt_tokens - r.cached_tokens for r in results)
    return Arm(name, wall, cpu, total, uncached, [r.prompt_logprobs.logprobs for r in results])


def worst_difference(a: Arm, b: Arm) -> float:
    pairs = zip(a.logprobs, b.logprobs, strict=True)
    return max(abs(x - y) for p, q in pairs for x, y in zip(p[1:], q[1:], strict=True))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = CacheConfig(device=args.device)
    model = quiet_load_model(args.model, check_cache_config(config))
    prompts = workload(args, model.vocab_size)
    arms = []
    for name, blocks in (("cached", None), ("no-cache", 0)):
        with Engine(model, config, prompt_logprob_blocks=blocks) as engine:
            engine.generate([prompts[0][:64]], SamplingParams(max_new_tokens=1))  # warm-up
            arms.append(run_arm(name, engine, prompts))
    print(f"{len(prompts)} requests ({args.questions} questions x {args.choices} choices), "
          f"{args.context}-token shared context, model {args.model}")  # fmt: skip
    print(f"{'arm':10s} {'wall s':>8s} {'cpu s':>8s} {'prompt tok':>11s} {'prefilled tok':>14s}")
    for a in arms:
        print(f"{a.name:10s} {a.wall_s:8.2f} {a.cpu_s:8.2f} {a.prompt_tokens:11d} "
              f"{a.uncached_tokens:14d}")  # fmt: skip
    cached, plain = arms
    print(f"speedup {plain.wall_s / cached.wall_s:.2f}x wall, {plain.cpu_s / cached.cpu_s:.2f}x "
          f"cpu; prefilled tokens "
          f"{plain.uncached_tokens / max(cached.uncached_tokens, 1):.1f}x fewer; worst prompt "
          f"logprob difference {worst_difference(cached, plain):.2e}")  # fmt: skip
    return 0
