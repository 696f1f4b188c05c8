"""End-to-end time of a workload through the engine (device tier) vs no prefix cache.

Each workload (bench/workloads.py, scaled down) runs three ways in the same process:
- nocache: HF `model.generate` per request, greedy, no prefix cache;
- kvstore: `Engine.run` per request, in arrival order, with a device-tier PrefixCache
  (warm-up excluded);
- peer: transformers continuous batching (CB) with block sharing
  (`ContinuousBatchingConfig(allow_block_sharing=True)`), in two modes, each on a fresh
  manager that first serves, outside timing, a warm-up of the same shape as the workload but
  unrelated tokens (bench/e2e/peer.py runs the modes, bench/cb_peer.py one run):
  - batch: every prompt in one `generate_batch` call on a persistent manager (CB's natural
    mode, best batching; the call's manager start and stop are timed);
  - serving: one long-lived running manager fed as a server would be, one `add_request` at a
    time in arrival order, each sent once the previous result is back, as the engine serves
    them (multi-turn prompts are fixed by the workload, not built from earlier outputs, for
    all three runs).
  Each mode reports its total time, `cb_prefix_matched_tokens` (summed from CB's DEBUG
  "Found a prefix match" records, its only trace of sharing: see bench/cb_peer.py) and how
  many outputs meet the contract (below); the peer's `total_s` and `kvstore_speedup_over_peer`
  are those of the faster mode (`best_mode`). CB hashes a request's blocks only after its
  prefill forward, so prompts prefilled together share nothing: batch mode matches little or
  nothing, serving mode what the earlier requests' whole pages hold. Pages are
  `--block-size` tokens, as kvstore's blocks, and the paged cache holds the warm-up's and the
  workload's pages (`num_blocks`), so nothing is evicted and CB does not size it from free
  RAM (tens of seconds on CPU). A mode that fails (error, stopped loop, a request unanswered
  after a timeout) reports `error`, printed under the table.

Outputs. `contract_outputs` counts the outputs that meet the output contract (README.md,
"Correctness"): every greedy token is the argmax of one full no-cache forward over the prompt
and the tokens before it, wherever that forward's top-2 gap exceeds 1e-4. `same_outputs`
counts outputs equal to HF `generate`'s; they differ where the argmax is the EOS token,
which `generate` (asked for exactly `--new-tokens` with `min_new_tokens`) suppresses and the
other paths emit and go on.

Repeats. This machine's load drifts by tens of percent within a minute, so each timed path
runs `--repeats` times, the paths alternating within each repeat (HF no cache, the engine
with nothing cached, the engine's prefills of the reusable prefixes, the free-prefix
engine, kvstore), and each
path's fastest run counts (noise only ever adds time). A kvstore repeat starts from an empty
device pool. CB runs after them, on fresh managers: batch once (6-13x slower, one run says as
much), then serving `--repeats` times. Every run's total is reported (`*_runs_s`), so the
spread is visible; `runs_agree` says every kvstore run gave the same outputs and cached the
same tokens.

Ideal speedup. `reusable_tokens` is what an unbounded prefix cache could skip: per request,
the longest block-aligned prefix of its prompt that an earlier request's stored tokens
(prompt + generated tokens) already hold. The work a cache saves is exactly the prefill of
that prefix (its K/V does not depend on what follows). The ideal is measured in the engine
itself, so that it credits the cache alone and not the engine's lighter per-call and
per-step path compared with `generate`: engine_nocache_s is the engine serving the workload
with its pool emptied (untimed) before each request, prefix_s the engine's prefill of every
reusable prefix alone on an empty pool (`Engine.prefill`, summed; the fastest repeat's sum),

    ideal_s = engine_nocache_s - prefix_s,  ratio_to_ideal = ideal_s / kvstore_s,
    speedup = nocache_s / kvstore_s,  ideal_speedup = nocache_s / ideal_s

(nocache_s: HF `generate`, so ratio_to_ideal = speedup / ideal_speedup). Each prefix's
prefill is its own forward, whose fixed cost a cached request does not save, so the ideal is
slightly optimistic and the ratio conservative. Also reported, as before this definition:
`proportional_ideal_speedup`, which charges each reusable token its prompt's average HF
no-cache cost, ttft_i / prompt_tokens_i. That overstates the saving: tokens late in a prompt
attend to more keys than the prefix's tokens, and the suffix a cached request still prefills
is exactly those late tokens (on this machine a 100-token suffix after 800 cached tokens
takes 42 ms, against 30 ms at the average per-token cost of the 900-token prompt).

Free prefix. The token-savings ideal cannot be reached where suffixes are short: each
suffix is a forward of its own, with a floor that saving the prefix's tokens does not
remove. `free_prefix_s` times the ideal engine instead, the yardstick of `bench ttft`: each
request's reusable prefix already in memory as a `DynamicCache` (built untimed), the
suffix prefilled on it and the tokens decoded as the engine does, with no lookup, load or
store. `ratio_to_free_prefix` = free_prefix_s / kvstore_s is the share of kvstore's time
that any prefix cache would spend; the rest is kvstore's own cost.
"""

from __future__ import annotations

import argparse
import json
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from bench.e2e.paths import (
    RunResult,
    run_engine_nocache,
    run_free_prefix,
    run_kvstore,
    run_nocache,
    run_prefixes,
)
from bench.e2e.peer import PEER_NAME, peer_cells, peer_errors, run_peer
from engine.contract import count_meeting_contract
from kvstore.config import ConfigError
from kvstore.device.pool import resolve_device

# row name -> (bench/workloads.py generator, its parameters)
SCALES = {
    "small": {
        "shared-prefix": ("shared-prefix", {"num_groups": "2", "prompts_per_group": "2",
                          "system_prompt_len": "64", "question_len": "8", "zipf_s": "0"}),
        "multiturn": ("multiturn", {"num_clients": "1", "num_turns": "3", "turn_tokens": "8",
                      "answer_tokens": "4", "system_prompt_len": "32"}),
        "multiturn-short": ("multiturn", {"num_clients": "1", "num_turns": "2",
                            "turn_tokens": "4", "answer_tokens": "4", "system_prompt_len": "16"}),
    },
    "default": {
        "shared-prefix": ("shared-prefix", {"num_groups": "4", "prompts_per_group": "4",
                          "system_prompt_len": "768", "question_len": "64", "zipf_s": "0"}),
        # the generator's own turn and answer lengths, fewer clients and turns
        "multiturn": ("multiturn", {"num_clients": "2", "num_turns": "4", "turn_tokens": "256",
                      "answer_tokens": "256", "system_prompt_len": "512"}),
        # short turns: each request prefills ~100 tokens in a forward of its own
        "multiturn-short": ("multiturn", {"num_clients": "3", "num_turns": "4",
                            "turn_tokens": "64", "answer_tokens": "32",
                            "system_prompt_len": "512"}),
    },
}  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench e2e", description=__doc__.split("\n")[0])
    p.add_argument("--workload", default=",".join(SCALES["default"]))
    p.add_argument("--scale", default="default", choices=sorted(SCALES))
    p.add_argument("--model", default="tiny", help="tiny, smollm2, dummy:NAME, a .gguf file or a "
                   "model directory")  # fmt: skip
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="the model's and the KV pool's device")  # fmt: skip
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16; auto: "
                   "float32, and a dummy:NAME model's bfloat16 on a GPU")  # fmt: skip
    p.add_argument("--new-tokens", type=int, default=4, help="generated tokens per request")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per path; the fastest counts")
    p.add_argument("--no-peer", action="store_true", help="skip continuous batching")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workload.split(",") if w.strip()]
    for name in args.workloads:
        if name not in SCALES["default"]:
            p.error(f"--workload: unknown {name!r}; choose from {','.join(SCALES['default'])}")
    try:  # the pool's own check: a GPU this machine has
        resolve_device(args.device)
    except ConfigError as e:
        p.error(f"--{e}")
    if args.new_tokens < 1:
        p.error("--new-tokens must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def workload_prompts(name: str, scale: str, vocab_size: int) -> list[list[int]]:
    """The scaled workload's prompts in arrival order (token ids below `vocab_size`)."""
    from bench.workloads import make_workload

    generator, params = SCALES[scale][name]
    params = {**params, "vocab_size": str(vocab_size)}
    return [r.token_ids.tolist() for r in make_workload(generator, params).generate()]


def reusable_tokens(prompts: Sequence[list[int]], outputs: Sequence[list[int]], block: int) -> int:
    """Sum over requests of the longest block-aligned prompt prefix an earlier request stored."""
    stored: set[tuple[int, ...]] = set()
    total = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        full = len(prompt) // block
        hit = 0
        while hit < full and tuple(prompt[: (hit + 1) * block]) in stored:
            hit += 1
        total += hit * block
        seq = prompt + output[:-1]  # the last generated token has no KV
        stored.update(tuple(seq[: (k + 1) * block]) for k in range(len(seq) // block))
    return total


def ideal_time(engine_nocache_s: float, prefix_s: float) -> float:
    """The engine's no-cache time minus its prefill time of every reusable prefix."""
    return engine_nocache_s - prefix_s


def proportional_ideal_time(
    nocache: RunResult, prompts: Sequence[list[int]], reusable: list[int]
) -> float:
    """nocache_s minus each request's average per-token prefill cost times its reusable tokens."""
    saved = sum(t / len(p) * r for t, p, r in zip(nocache.ttfts, prompts, reusable, strict=True))
    return nocache.total_s - saved


def per_request_reusable(
    prompts: list[list[int]], outputs: list[list[int]], block: int
) -> list[int]:
    return [
        reusable_tokens(prompts[: i + 1], outputs[: i + 1], block)
        - reusable_tokens(prompts[:i], outputs[:i], block)
        for i in range(len(prompts))
    ]


# the Timings fields that hold RunResults
RUN_PATHS = ("nocache", "engine_nocache", "free_prefix", "kvstore")


class Timings(NamedTuple):
    """Every repeat of the timed paths."""

    nocache: list[RunResult]  # HF generate, no cache
    engine_nocache: list[RunResult]  # the engine, pool emptied before each request
    prefix_s: list[float]  # the engine's prefill of the reusable prefixes, summed
    free_prefix: list[RunResult]  # every prefix handed over in memory for free
    kvstore: list[RunResult]


def summarize(name: str, prompts: list[list[int]], reusable: list[int], t: Timings) -> dict:
    nocache, kvstore, free = fastest(t.nocache), fastest(t.kvstore), fastest(t.free_prefix)
    engine_nocache_s, prefix_s = fastest(t.engine_nocache).total_s, min(t.prefix_s)
    ideal_s = ideal_time(engine_nocache_s, prefix_s)
    proportional_s = proportional_ideal_time(nocache, prompts, reusable)
    return {
        "workload": name,
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "cached_tokens": kvstore.cached_tokens,
        "reusable_tokens": sum(reusable),
        "nocache_s": nocache.total_s,
        "engine_nocache_s": engine_nocache_s,
        "prefix_prefill_s": prefix_s,
        "kvstore_s": kvstore.total_s,
        "ideal_s": ideal_s,
        "speedup": nocache.total_s / kvstore.total_s,
        "ideal_speedup": nocache.total_s / ideal_s,
        "ratio_to_ideal": ideal_s / kvstore.total_s,
        "proportional_ideal_speedup": nocache.total_s / proportional_s,
        "free_prefix_s": free.total_s,
        "ratio_to_free_prefix": free.total_s / kvstore.total_s,
        "free_prefix_same_outputs": sum(map(operator.eq, free.outputs, kvstore.outputs)),
        "same_outputs": sum(map(operator.eq, nocache.outputs, kvstore.outputs)),
        "runs_agree": len({(repr(r.outputs), r.cached_tokens) for r in t.kvstore}) == 1,
        **{f"{k}_runs_s": [r.total_s for r in getattr(t, k)] for k in RUN_PATHS},
        "prefix_runs_s": t.prefix_s,
    }


def add_peer(row: dict, peer: dict) -> dict:
    if "total_s" in peer:
        peer = {**peer, "kvstore_speedup_over_peer": peer["total_s"] / row["kvstore_s"]}
    return {**row, "peer": peer}


def warm_up(lm, engine, new_tokens: int, bar_cls) -> None:
    """One unrelated request through each path, outside timing (first-call overheads)."""
    ids = [[(7 * i) % 256 for i in range(48)]]
    with bar_cls(total=4, disable=True) as bar:
        run_nocache(engine, lm, ids, new_tokens, bar)
        run_kvstore(engine, ids, new_tokens, bar)
        run_prefixes(engine, ids, [32], bar)
        run_free_prefix(engine, lm, ids, [32], new_tokens, bar)
    engine.cache.evict_device()


def time_paths(lm, engine, prompts: list[list[int]], args: argparse.Namespace,
               bar) -> tuple[Timings, list[int]]:  # fmt: skip
    """`--repeats` rounds of the five paths, alternating, so a slow spell hits every path;
    and each request's reusable tokens."""
    t, reusable = Timings([], [], [], [], []), None
    for _ in range(args.repeats):
        t.nocache.append(run_nocache(engine, lm, prompts, args.new_tokens, bar))
        if reusable is None:
            reusable = per_request_reusable(prompts, t.nocache[0].outputs, args.block_size)
        t.engine_nocache.append(run_engine_nocache(engine, prompts, args.new_tokens, bar))
        t.prefix_s.append(run_prefixes(engine, prompts, reusable, bar))
        t.free_prefix.append(run_free_prefix(engine, lm, prompts, reusable, args.new_tokens, bar))
        engine.cache.evict_device()  # kvstore starts empty
        t.kvstore.append(run_kvstore(engine, prompts, args.new_tokens, bar))
    return t, reusable or []


def run_workload(lm, name: str, args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from engine.loop.engine import Engine
    from kvstore.config import CacheConfig

    prompts = workload_prompts(name, args.scale, 256)
    blocks = sum(len(p) + args.new_tokens for p in prompts) // args.block_size + 8
    config = CacheConfig(block_size=args.block_size, device=args.device, device_blocks=blocks)
    with Engine(lm, config) as engine, torch.inference_mode():
        warm_up(lm, engine, args.new_tokens, tqdm)
        with tqdm(total=5 * args.repeats * len(prompts), desc=name, leave=False) as bar:
            timings, reusable = time_paths(lm, engine, prompts, args, bar)
    nocache, kvstore = fastest(timings.nocache), fastest(timings.kvstore)
    row = summarize(name, prompts, reusable, timings)
    row["contract_outputs"] = count_meeting_contract(lm, prompts, kvstore.outputs, args.new_tokens)
    if args.no_peer:
        return add_peer(row, {"name": PEER_NAME, "error": "skipped (--no-peer)"})
    new, block, repeats = args.new_tokens, args.block_size, args.repeats
    peer = run_peer(lm, prompts, nocache.outputs, new, block, repeats, tqdm)
    return add_peer(row, peer)


def fastest(runs: list[RunResult]) -> RunResult:
    return min(runs, key=operator.attrgetter("total_s"))


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="End-to-end, fp32, device tier vs HF generate (no cache)")
    cols = ("workload", "reqs", "contract ok", "prompt tok", "cached", "reusable", "no cache s",
            "kvstore s",
            "speedup", "ideal", "ratio", "prop. ideal", "/ free prefix", "CB batch s (matched)",
            "CB serving s (matched)",
            "kvstore vs CB")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["workload"], str(r["requests"]), str(r["contract_outputs"]),
            str(r["prompt_tokens"]), str(r["cached_tokens"]),
            str(r["reusable_tokens"]), f"{r['nocache_s']:.2f}", f"{r['kvstore_s']:.2f}",
            f"{r['speedup']:.2f}", f"{r['ideal_speedup']:.2f}", f"{r['ratio_to_ideal']:.3f}",
            f"{r['proportional_ideal_speedup']:.2f}", f"{r['ratio_to_free_prefix']:.3f}",
            *peer_cells(r["peer"]),
        )  # fmt: skip
    Console().print(table)
    for r in rows:
        for error in peer_errors(r["peer"]):
            print(f"peer on {r['workload']}: {error}")


def main(argv: list[str], model=None) -> int:
    """`model` (a LoadedModel) replaces the pinned tiny model, for tests."""
    from transformers.utils import logging as hf_logging

    from engine.model.loading import load_model

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    lm = model or load_model(args.model, args.dtype, args.device)
    rows = [run_workload(lm, name, args) for name in args.workloads]
    if args.json:
        print(json.dumps({"workloads": rows}))
    else:
        print_table(rows)
    return 0
