"""`python -m bench nsample`: parallel sampling (`n` sequences of one prompt) against one
sequence, side by side in one engine: pairs run back to back (n=1, then n), a fresh prompt
each run so that no run hits another's blocks. A group prefills its prompt once and shares
its blocks (docs/ARCHITECTURE.md, "Parallel sampling"), so its cost over n=1 is the other
sequences' decode rows; the ratio is what to compare, absolute times drift."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from engine.commands import quiet_load_model
from engine.loop.engine import Engine
from engine.loop.group import SequenceGroup, branch_params
from engine.loop.request import Request, SamplingParams
from kvstore.config import CacheConfig


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench nsample", description=__doc__)
    p.add_argument("--model", default="tiny", help="tiny, smollm2, a .gguf file or a directory")
    p.add_argument("--n", type=int, default=4, help="sequences of the group")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


class Runs:
    """Groups of `n` sequences on fresh prompts, timed from submit to the last result."""

    def __init__(self, engine: Engine, args: argparse.Namespace, vocab: int):
        self.engine, self.args, self.vocab = engine, args, vocab
        self.params = SamplingParams(
            max_new_tokens=args.new_tokens, ignore_eos=True, temperature=1.0, seed=1
        )
        self.rng = np.random.default_rng(0)

    def run(self, n: int) -> dict:
        prompt = self.rng.integers(10, self.vocab - 10, self.args.prompt_tokens).tolist()
        start = time.perf_counter()
        group = SequenceGroup([Request(list(prompt), p) for p in branch_params(self.params, n)])
        self.engine.add_group(group)
        results = [r.future.result(600) for r in group.requests]
        wall = time.perf_counter() - start
        return {"wall_s": wall, "cached": [r.cached_tokens for r in results]}


def measure(args: argparse.Namespace) -> list[tuple[dict, dict]]:
    model = quiet_load_model(args.model, "cpu")
    with Engine(model, CacheConfig(device_blocks=2048)) as engine:
        runs = Runs(engine, args, len(model.tokenizer))
        runs.run(1), runs.run(args.n)  # warm-up
        bar = tqdm(range(args.pairs), desc="pairs", unit="pair", file=sys.stderr)
        return [(runs.run(1), runs.run(args.n)) for _ in bar]


def table(pairs: list[tuple[dict, dict]], args: argparse.Namespace) -> Table:
    t = Table(title=f"n={args.n} against n=1, {args.prompt_tokens}-token prompt, "
              f"{args.new_tokens} new tokens each, {args.model}")  # fmt: skip
    for col in ("pair", "n=1 ms", f"n={args.n} ms", "ratio", "prompt tokens cached"):
        t.add_column(col, justify="right")
    for i, (one, many) in enumerate(pairs, 1):
        ratio = many["wall_s"] / one["wall_s"]
        cached = " ".join(str(c) for c in many["cached"])
        t.add_row(str(i), f"{one['wall_s'] * 1e3:.0f}", f"{many['wall_s'] * 1e3:.0f}",
                  f"{ratio:.2f}", cached)  # fmt: skip
    ones = [a["wall_s"] for a, _ in pairs]
    manys = [b["wall_s"] for _, b in pairs]
    med = statistics.median(b / a for a, b in zip(ones, manys, strict=True))
    t.add_row("median", f"{statistics.median(ones) * 1e3:.0f}",
              f"{statistics.median(manys) * 1e3:.0f}", f"{med:.2f}", "")  # fmt: skip
    return t


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    pairs = measure(args)
    if args.json:
        print(json.dumps({"model": args.model, "n": args.n, "pairs": pairs}))
    else:
        Console().print(table(pairs, args))
    return 0
