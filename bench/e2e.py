"""End-to-end time of a workload through the engine (device tier) vs no prefix cache.

Each workload (bench/workloads.py, scaled down) runs three ways in the same process:
- nocache: HF `model.generate` per request, greedy, no prefix cache;
- kvstore: `Engine.run` per request, in arrival order, with a device-tier PrefixCache
  (warm-up excluded);
- peer: transformers continuous batching (CB) with block sharing
  (`ContinuousBatchingConfig(allow_block_sharing=True)`), in two modes, each on a fresh
  manager that first serves, outside timing, a warm-up of the same shape as the workload but
  unrelated tokens (bench/cb_peer.py):
  - batch: every prompt in one `generate_batch` call on a persistent manager (CB's natural
    mode, best batching; the call's manager start and stop are timed);
  - serving: one long-lived running manager fed as a server would be, one `add_request` at a
    time in arrival order, each sent once the previous result is back, as the engine serves
    them (multi-turn prompts are fixed by the workload, not built from earlier outputs, for
    all three runs).
  Each mode reports its total time, `cb_prefix_matched_tokens` (summed from CB's DEBUG
  "Found a prefix match" records, its only trace of sharing: see bench/cb_peer.py) and how
  many outputs equal HF `generate`'s; the peer's `total_s` and `kvstore_speedup_over_peer`
  are those of the faster mode (`best_mode`). CB hashes a request's blocks only after its
  prefill forward, so prompts prefilled together share nothing: batch mode matches little or
  nothing, serving mode what the earlier requests' whole pages hold. Pages are
  `--block-size` tokens, as kvstore's blocks, and the paged cache holds the warm-up's and the
  workload's pages (`num_blocks`), so nothing is evicted and CB does not size it from free
  RAM (tens of seconds on CPU). A mode that fails (error, stopped loop, a request unanswered
  after a timeout) reports `error`, printed under the table.

Ideal speedup. `reusable_tokens` is what an unbounded prefix cache could skip: per request,
the longest block-aligned prefix of its prompt that an earlier request's stored tokens
(prompt + generated tokens) already hold. The no-cache prefill cost per token of request
i is c_i = ttft_i / prompt_tokens_i (its TTFT under `model.generate`, from a streamer), so

    ideal_s = nocache_s - sum_i c_i * reusable_i,  ideal_speedup = nocache_s / ideal_s,
    speedup = nocache_s / kvstore_s,  ratio_to_ideal = speedup / ideal_speedup.

A suffix prefilled on top of a cached prefix attends to more keys than the same tokens at
the start of a prompt, so the ideal is slightly optimistic and the ratio conservative.
"""

from __future__ import annotations

import argparse
import json
import operator
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from bench.cb_peer import (
    cb_config,
    counting_prefix_matches,
    greedy_config,
    pages_for,
    run_batch,
    serve_in_order,
)
from bench.ttft_point import FirstTokenClock

SCALES = {
    "small": {
        "shared-prefix": {"num_groups": "2", "prompts_per_group": "2", "system_prompt_len": "64",
                          "question_len": "8", "zipf_s": "0"},
        "multiturn": {"num_clients": "1", "num_turns": "3", "turn_tokens": "8",
                      "answer_tokens": "4", "system_prompt_len": "32"},
    },
    "default": {
        "shared-prefix": {"num_groups": "4", "prompts_per_group": "4", "system_prompt_len": "768",
                          "question_len": "64", "zipf_s": "0"},
        "multiturn": {"num_clients": "3", "num_turns": "4", "turn_tokens": "64",
                      "answer_tokens": "32", "system_prompt_len": "512"},
    },
}  # fmt: skip
PEER_NAME = "transformers continuous batching (allow_block_sharing)"
PEER_RUNS = {"batch": run_batch, "serving": serve_in_order}
PEER_MODES = tuple(PEER_RUNS)


class RunResult(NamedTuple):
    total_s: float
    outputs: list[list[int]]
    ttfts: list[float]  # per request
    cached_tokens: int


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench e2e", description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="shared-prefix,multiturn")
    p.add_argument("--scale", default="default", choices=sorted(SCALES))
    p.add_argument("--new-tokens", type=int, default=4, help="generated tokens per request")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--no-peer", action="store_true", help="skip continuous batching")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workload.split(",") if w.strip()]
    for name in args.workloads:
        if name not in SCALES["default"]:
            p.error(f"--workload: unknown {name!r}; choose from {','.join(SCALES['default'])}")
    if args.new_tokens < 1:
        p.error("--new-tokens must be >= 1")
    return args


def workload_prompts(name: str, scale: str, vocab_size: int) -> list[list[int]]:
    """The scaled workload's prompts in arrival order (token ids below `vocab_size`)."""
    from bench.workloads import make_workload

    params = {**SCALES[scale][name], "vocab_size": str(vocab_size)}
    return [r.token_ids.tolist() for r in make_workload(name, params).generate()]


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


def ideal_time(nocache: RunResult, prompts: Sequence[list[int]], reusable: list[int]) -> float:
    """nocache_s minus the no-cache prefill cost of each request's reusable tokens."""
    saved = sum(t / len(p) * r for t, p, r in zip(nocache.ttfts, prompts, reusable, strict=True))
    return nocache.total_s - saved


def per_request_reusable(prompts: list[list[int]], outputs: list[list[int]], block: int) -> list:
    return [
        reusable_tokens(prompts[: i + 1], outputs[: i + 1], block)
        - reusable_tokens(prompts[:i], outputs[:i], block)
        for i in range(len(prompts))
    ]


def run_nocache(lm, prompts: list[list[int]], new_tokens: int, bar) -> RunResult:
    model, outputs, ttfts = lm.model, [], []
    start = time.perf_counter()
    for ids in prompts:
        clock, t0 = FirstTokenClock(), time.perf_counter()
        out = model.generate(
            torch.tensor([ids], device=lm.device),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=lm.device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=model.config.pad_token_id,
            streamer=clock,
        )
        ttfts.append(clock.first - t0)
        outputs.append(out[0, len(ids) :].tolist())
        bar.update(1)
    return RunResult(time.perf_counter() - start, outputs, ttfts, 0)


def run_kvstore(engine, prompts: list[list[int]], new_tokens: int, bar) -> RunResult:
    from engine.engine import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    outputs, ttfts, cached = [], [], 0
    start = time.perf_counter()
    for ids in prompts:
        result = engine.run(ids, params)
        outputs.append(result.output_token_ids)
        ttfts.append(result.ttft_s)
        cached += result.cached_tokens
        bar.update(1)
    return RunResult(time.perf_counter() - start, outputs, ttfts, cached)


def run_peer(lm, prompts: list[list[int]], nocache: RunResult, new_tokens: int, block: int,
             bar_cls) -> dict:  # fmt: skip
    """CB in both modes, each on a fresh manager; the faster mode's time is the peer's."""
    peer: dict = {"name": PEER_NAME, "page_size": block, "modes": {}}
    with counting_prefix_matches() as counter:
        for mode in PEER_MODES:
            with bar_cls(total=len(prompts), desc=f"CB {mode}", leave=False) as bar:
                result = run_peer_mode(lm, prompts, new_tokens, block, mode, counter, bar)
            if "outputs" in result:
                outputs = result.pop("outputs")
                result["same_outputs"] = sum(map(operator.eq, outputs, nocache.outputs))
            peer["modes"][mode] = result
    timed = [m for m in PEER_MODES if "total_s" in peer["modes"][m]]
    if not timed:
        errors = "; ".join(f"{m}: {peer['modes'][m]['error']}" for m in PEER_MODES)
        return {**peer, "error": errors}
    best = min(timed, key=lambda m: peer["modes"][m]["total_s"])
    fields = {k: peer["modes"][best][k] for k in ("total_s", "cb_prefix_matched_tokens")}
    return {**peer, "best_mode": best, **fields}


def run_peer_mode(lm, prompts, new_tokens: int, block: int, mode: str, counter, bar) -> dict:
    """One mode on a fresh manager, after a warm-up on prompts of the same shape."""
    model = lm.model
    warm = [[(t + 97) % 256 for t in reversed(p)] for p in prompts]  # same shape, no shared blocks
    # room for the warm-up's blocks and the workload's: a full cache evicts every cached block
    blocks = 2 * pages_for(prompts, new_tokens, block) + 2 * len(prompts) + 8
    cb, gen = cb_config(block, blocks), greedy_config(model, new_tokens)
    try:
        model.destroy_cached_continuous_batching_manager()
        total, outputs = PEER_RUNS[mode](model, warm, prompts, gen, cb, counter, bar)
    except Exception as e:  # reported in the output, never hidden
        return {"num_blocks": blocks, "error": f"{type(e).__name__}: {e}"}
    finally:
        model.destroy_cached_continuous_batching_manager()
    return {"total_s": total, "cb_prefix_matched_tokens": counter.tokens, "num_blocks": blocks,
            "outputs": outputs}  # fmt: skip


def summarize(name: str, prompts, nocache: RunResult, kvstore: RunResult, block: int) -> dict:
    reusable = per_request_reusable(prompts, nocache.outputs, block)
    ideal_s = ideal_time(nocache, prompts, reusable)
    speedup = nocache.total_s / kvstore.total_s
    ideal_speedup = nocache.total_s / ideal_s
    same = sum(a == b for a, b in zip(nocache.outputs, kvstore.outputs, strict=True))
    return {
        "workload": name,
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "cached_tokens": kvstore.cached_tokens,
        "reusable_tokens": sum(reusable),
        "nocache_s": nocache.total_s,
        "kvstore_s": kvstore.total_s,
        "ideal_s": ideal_s,
        "speedup": speedup,
        "ideal_speedup": ideal_speedup,
        "ratio_to_ideal": speedup / ideal_speedup,
        "same_outputs": same,
    }


def add_peer(row: dict, peer: dict) -> dict:
    if "total_s" in peer:
        peer = {**peer, "kvstore_speedup_over_peer": peer["total_s"] / row["kvstore_s"]}
    return {**row, "peer": peer}


def warm_up(lm, engine, new_tokens: int, bar_cls) -> None:
    """One unrelated request through each path, outside timing (first-call overheads)."""
    ids = [[(7 * i) % 256 for i in range(48)]]
    with bar_cls(total=2, disable=True) as bar:
        run_nocache(lm, ids, new_tokens, bar)
        run_kvstore(engine, ids, new_tokens, bar)
    engine.cache.evict_device()


def run_workload(lm, name: str, args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from engine.engine import Engine
    from kvstore.config import CacheConfig

    prompts = workload_prompts(name, args.scale, 256)
    blocks = sum(len(p) + args.new_tokens for p in prompts) // args.block_size + 8
    config = CacheConfig(block_size=args.block_size, device="cpu", device_blocks=blocks)
    with Engine(lm, config) as engine, torch.inference_mode():
        warm_up(lm, engine, args.new_tokens, tqdm)
        with tqdm(total=len(prompts), desc=f"{name} no cache", leave=False) as bar:
            nocache = run_nocache(lm, prompts, args.new_tokens, bar)
        with tqdm(total=len(prompts), desc=f"{name} kvstore", leave=False) as bar:
            kvstore = run_kvstore(engine, prompts, args.new_tokens, bar)
    row = summarize(name, prompts, nocache, kvstore, args.block_size)
    if args.no_peer:
        return add_peer(row, {"name": PEER_NAME, "error": "skipped (--no-peer)"})
    return add_peer(row, run_peer(lm, prompts, nocache, args.new_tokens, args.block_size, tqdm))


def peer_cells(peer: dict) -> list[str]:
    """'s (matched tokens)' per CB mode, then kvstore's speedup over the faster mode."""
    modes = peer.get("modes", {})
    cells = [
        f"{modes[m]['total_s']:.2f} ({modes[m]['cb_prefix_matched_tokens']})"
        if "total_s" in modes.get(m, {}) else "error"
        for m in PEER_MODES
    ]  # fmt: skip
    if "total_s" not in peer:
        return [*cells, "-"]
    return [*cells, f"{peer['kvstore_speedup_over_peer']:.2f}x ({peer['best_mode']})"]


def peer_errors(peer: dict) -> list[str]:
    if "modes" not in peer:
        return [peer["error"]]
    return [f"{m}: {r['error']}" for m, r in peer["modes"].items() if "error" in r]


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="End-to-end, tiny model fp32, device tier vs HF generate (no cache)")
    cols = ("workload", "reqs", "prompt tok", "cached", "reusable", "no cache s", "kvstore s",
            "speedup", "ideal", "ratio", "CB batch s (matched)", "CB serving s (matched)",
            "kvstore vs CB")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["workload"], str(r["requests"]), str(r["prompt_tokens"]), str(r["cached_tokens"]),
            str(r["reusable_tokens"]), f"{r['nocache_s']:.2f}", f"{r['kvstore_s']:.2f}",
            f"{r['speedup']:.2f}", f"{r['ideal_speedup']:.2f}", f"{r['ratio_to_ideal']:.3f}",
            *peer_cells(r["peer"]),
        )  # fmt: skip
    Console().print(table)
    for r in rows:
        for error in peer_errors(r["peer"]):
            print(f"peer on {r['workload']}: {error}")


def main(argv: list[str], model=None) -> int:
    """`model` (a LoadedModel) replaces the pinned tiny model, for tests."""
    from transformers.utils import logging as hf_logging

    from engine.model import load_model

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    lm = model or load_model("tiny", "float32", "cpu")
    rows = [run_workload(lm, name, args) for name in args.workloads]
    if args.json:
        print(json.dumps({"workloads": rows}))
    else:
        print_table(rows)
    return 0
