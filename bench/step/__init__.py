"""`python -m bench step`: host work per decode step, kvstore beside transformers' continuous
batching, on a model whose forward costs almost nothing.

    python -m bench step [--batches 1,8,32] [--new-tokens 48] [--prompt-tokens 16]
        [--rounds 3] [--model micro|tiny|dummy:NAME] [--device cpu|cuda] [--no-peer] [--json]

On the micro model (2 layers, hidden 64; engine/model/tiny.py) a decode step's kernels cost
a few microseconds: what a step takes is the host's work (Python, the dispatcher, metadata,
sampling, bookkeeping). On a GPU that work sets the pace of decode unless it is hidden
(graph replay, async scheduling), so this CPU figure predicts the GPU gap.

For each batch size B, B prompts of --prompt-tokens distinct tokens each generate
--new-tokens greedy tokens (EOS ignored), on kvstore's `Engine` (its defaults: decode graphs
where the model allows them) and on transformers' `generate_batch` with continuous batching
(a second copy of the same seeded weights: kvstore's engine holds its model's attention
while it runs; the peer's attention as transformers picks it for continuous batching, which
the output names). A step's host time is the wall time of one
iteration of each engine's loop (kvstore: `Stepper.step`; transformers:
`ContinuousBatchingManager._generation_loop_body`); the figure is the median over the run's
steps, which are nearly all decode steps (the prompts prefill in one or two), of the median
of --rounds rounds; kvstore and the peer run side by side in each round (the order flipped
every round), and the ratio is the median of the rounds' ratios. Ops per step are the
torch operators the host dispatches in one step (a `TorchDispatchMode` counting them, in a
run of its own so that counting costs no time above). One warm-up run per engine and batch
size comes first (graphs captured, caches filled). Both loops run --threads torch threads
(default 1: with 2 on a 2-core machine, the worker wake-ups made either engine's step swing
by 1.5x from one run to the next).

--json prints {"rows": [{"batch", "kvstore_host_us", "peer_host_us", "kvstore_ops",
"peer_ops"}, ...], ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from rich.console import Console
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

from engine.loop.engine import Engine
from engine.loop.request import SamplingParams
from engine.loop.scheduler_config import SchedulerConfig
from engine.loop.threads import ThreadConfig
from engine.model.loading import LoadedModel, load_model, wrap_model
from engine.model.tiny import byte_tokenizer, micro_config, random_model
from kvstore.config import CacheConfig
from kvstore.units import cdiv

BLOCK_SIZE = 16


class OpCounter(TorchDispatchMode):
    """Counts the torch operators dispatched while active (on the thread that entered it)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class StepClock:
    """Wraps one engine's loop iteration: each one's wall time, or (counting) its ops, with
    the calling thread's torch threads set to `threads` first."""

    def __init__(self, threads: int) -> None:
        self.seconds: list[float] = []
        self.ops: list[int] = []
        self.counting = False
        self.threads = threads

    def wrap(self, step: Callable) -> Callable:
        def timed(*args: object, **kwargs: object) -> object:
            if torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
            if self.counting:
                with OpCounter() as counter:
                    out = step(*args, **kwargs)
                self.ops.append(counter.ops)
                return out
            start = time.perf_counter()
            out = step(*args, **kwargs)
            self.seconds.append(time.perf_counter() - start)
            return out

        return timed

    def reset(self, counting: bool) -> None:
        self.seconds, self.ops, self.counting = [], [], counting


def prompts_for(batch: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    """`batch` prompts sharing no block (and not with other rounds: `salt`)."""
    return [[(7 * (salt * 101 + i) + 13 * j + 3) % (vocab - 3) + 3 for j in range(length)]
            for i in range(batch)]  # fmt: skip


class KvstoreSide:
    """kvstore's engine, its loop iteration wrapped."""

    name = "kvstore"

    def __init__(self, model: LoadedModel, max_batch: int, tokens: int, threads: int):
        blocks = max_batch * (cdiv(tokens, BLOCK_SIZE) + 1) * 3 + 8
        config = CacheConfig(block_size=BLOCK_SIZE, device=str(model.device), device_blocks=blocks)
        steps = SchedulerConfig(max_num_seqs=max(max_batch, 1))
        pinned = ThreadConfig(threads=threads, adapt=False)
        self.engine = Engine(model, config, scheduler_config=steps, thread_config=pinned)
        self.clock = StepClock(threads)
        stepper = self.engine.stepper
        if stepper is None:
            raise RuntimeError(f"kvstore serves {model.name} one request at a time")
        stepper.step = self.clock.wrap(stepper.step)

    def run(self, prompts: list[list[int]], new_tokens: int) -> None:
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        self.engine.generate(prompts, params)

    @property
    def how(self) -> str:
        graphs = self.engine.runner.graphs
        replay = "eager" if graphs is None or graphs.disabled else type(graphs.backend).__name__
        return f"decode: {replay}, linears {self.engine.linear_kernel}"

    def close(self) -> None:
        self.engine.close()


class PeerSide:
    """transformers' continuous batching on the same model object."""

    name = "peer"

    def __init__(self, model: LoadedModel, max_batch: int, tokens: int, threads: int):
        from transformers.generation.continuous_batching.continuous_api import (
            ContinuousBatchingManager,
        )

        from bench.cb_peer import cb_config

        self.model = model
        self.config = cb_config(BLOCK_SIZE, max_batch * (cdiv(tokens, BLOCK_SIZE) + 1) * 3 + 8)
        self.clock = StepClock(threads)
        self.attention = "?"
        self._manager = ContinuousBatchingManager
        self._body = ContinuousBatchingManager._generation_loop_body

    @contextmanager
    def _wrapped(self) -> Iterator[None]:
        timed = self.clock.wrap(self._body)
        self._manager._generation_loop_body = timed
        try:
            yield
        finally:
            self._manager._generation_loop_body = self._body

    def run(self, prompts: list[list[int]], new_tokens: int) -> None:
        from bench.cb_peer import greedy_config

        lm = self.model.model
        gen = greedy_config(lm, new_tokens)
        with self._wrapped():
            out = lm.generate_batch(
                prompts, generation_config=gen, continuous_batching_config=self.config,
                progress_bar=False,
            )  # fmt: skip
        self.attention = str(lm.config._attn_implementation)
        lengths = {len(r.generated_tokens) for r in out.values()}
        if len(out) != len(prompts) or lengths != {new_tokens}:
            raise RuntimeError(f"the peer generated {sorted(lengths)} tokens, not {new_tokens}")

    @property
    def how(self) -> str:
        return f"attention {self.attention}"

    def close(self) -> None:
        pass


def measure(side, prompts: list[list[int]], new_tokens: int, counting: bool) -> float:
    """The median of one run's loop iterations: seconds, or (counting) ops."""
    side.clock.reset(counting)
    side.run(prompts, new_tokens)
    values = side.clock.ops if counting else side.clock.seconds
    values = [v for v in values if v]  # (an idle wait of the peer's loop counts nothing)
    return float(statistics.median(values))


def micro_model(device: str, dtype: torch.dtype) -> LoadedModel:
    model = random_model(micro_config(), seed=0).to(device=device, dtype=dtype)
    return wrap_model(model, byte_tokenizer(), "micro")


def load(args: argparse.Namespace) -> LoadedModel:
    """The model (a new object each call, the same seeded weights)."""
    if args.model == "micro":
        dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
        return micro_model(args.device, dtype)
    return load_model(args.model, args.dtype, args.device)


def run(args: argparse.Namespace) -> dict:
    model = load(args)
    tokens = args.prompt_tokens + args.new_tokens
    vocab = min(model.vocab_size, 256)  # ids every tokenizer of the models here has
    sides = [KvstoreSide(model, max(args.batches), tokens, args.threads)]
    if not args.no_peer:
        sides.append(PeerSide(load(args), max(args.batches), tokens, args.threads))
    rows = []
    total = len(args.batches) * len(sides) * (args.rounds + 2)
    with tqdm(total=total, desc="bench step", disable=args.json) as bar:
        for batch in args.batches:
            rows.append(_batch_row(sides, batch, args, vocab, bar))
    hows = {side.name: side.how for side in sides}
    for side in sides:
        side.close()
    return {"model": model.name, "device": str(model.device), "new_tokens": args.new_tokens,
            "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
            "threads": args.threads, "how": hows, "rows": rows}  # fmt: skip


def _batch_row(sides, batch: int, args, vocab: int, bar) -> dict:
    us: dict[str, list[float]] = {side.name: [] for side in sides}
    ops: dict[str, float] = {}
    salt = batch * 1000
    for side in sides:  # warm-up: graphs captured, first allocations
        side.clock.reset(counting=False)
        side.run(prompts_for(batch, args.prompt_tokens, vocab, salt), args.new_tokens)
        bar.update()
    for r in range(args.rounds):  # in turn, the order flipped each round (the machine drifts)
        for side in sides if r % 2 == 0 else sides[::-1]:
            prompts = prompts_for(batch, args.prompt_tokens, vocab, salt + r + 1)
            us[side.name].append(1e6 * measure(side, prompts, args.new_tokens, False))
            bar.update()
    for side in sides:
        prompts = prompts_for(batch, args.prompt_tokens, vocab, salt + args.rounds + 1)
        ops[side.name] = measure(side, prompts, args.new_tokens, True)
        bar.update()
    row = {"batch": batch}
    for side in sides:
        row[f"{side.name}_host_us"] = round(statistics.median(us[side.name]), 1)
        row[f"{side.name}_ops"] = round(ops[side.name])
    if "peer_host_us" in row:  # each round's pair measured side by side, then their median
        ratios = [k / p for k, p in zip(us["kvstore"], us["peer"], strict=True)]
        row["ratio"] = round(statistics.median(ratios), 3)
    return row


def print_table(result: dict) -> None:
    table = Table(title=f"host work per decode step: {result['model']} on {result['device']}, "
                        f"{result['new_tokens']} new tokens, median of {result['rounds']} "
                        "rounds")  # fmt: skip
    for col in ("batch", "kvstore µs", "peer µs", "kvstore ÷ peer", "kvstore ops", "peer ops"):
        table.add_column(col, justify="right")
    for row in result["rows"]:
        table.add_row(
            str(row["batch"]), f"{row['kvstore_host_us']:.0f}",
            f"{row.get('peer_host_us', float('nan')):.0f}", f"{row.get('ratio', float('nan')):.2f}",
            str(row["kvstore_ops"]), str(row.get("peer_ops", "-")),
        )  # fmt: skip
    Console(width=120).print(table)
    for name, how in result["how"].items():
        print(f"{name}: {how}")


def parse_batches(text: str) -> list[int]:
    try:
        batches = sorted({int(item) for item in text.split(",") if item.strip()})
    except ValueError:
        why = f"--batches takes ints like 1,8,32, not {text!r}"
        raise argparse.ArgumentTypeError(why) from None
    if not batches or batches[0] < 1:
        raise argparse.ArgumentTypeError("--batches must be ints >= 1")
    return batches


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench step",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--batches", type=parse_batches, default=[1, 8, 32], help="batch sizes")
    add("--new-tokens", type=positive, default=48, help="greedy tokens per request")
    add("--prompt-tokens", type=positive, default=16, help="prompt tokens per request")
    add("--rounds", type=positive, default=5, help="timed rounds per batch size")
    add("--model", default="micro", help="micro (default), tiny, dummy:NAME, or any --model")
    add("--device", default="cpu", help="cpu or cuda")
    add("--dtype", default="float32", choices=("float32", "bfloat16"))
    add("--threads", type=positive, default=1,
        help="torch threads of each engine's loop (the forward costs nothing: more threads "
        "only add their wake-ups, which swing from run to run)")  # fmt: skip
    add("--no-peer", action="store_true", help="kvstore only")
    add("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0
