"""`python -m bench ttft --sweep`: TTFT against prompt length x cached fraction, per tier.

Every prompt length in `--lengths` x cached fraction in `--fractions` (cached tokens rounded to
whole blocks) is measured for each tier (default device,memory,lmdb, plus redis with
`--redis-url`; tier "none" is the nocache column of every point) as in `bench.ttft`, with 3
rounds per point unless `--runs` says otherwise. Each point also carries two peers, run on the
same prompt in the same process:
- `ttft_hf_generate_s`: HF `model.generate` with no prefix cache, time to its first token
  (median over the rounds; once per prompt length, as it does not depend on the fraction);
- `ttft_cb_s`: transformers continuous batching with block sharing, one persistent manager per
  prompt length (`generate_batch`, `ContinuousBatchingConfig(allow_block_sharing=True)`,
  `persistent_manager=True`). A warm-up round on unrelated tokens is excluded; then per round an
  untimed seed request (the cached prefix + a fresh suffix) and a timed probe (the prefix +
  another fresh suffix, so only the prefix can be shared); TTFT is the wall time of the probe's
  `generate_batch` call with max_new_tokens=1 (median over the rounds);
  `ttft_cb_first_token_s` stops instead at the probe's own token timestamp
  (`record_timestamps`), leaving out the call's teardown (stopping and joining the manager's
  thread, restoring the attention implementation, `gc.collect`), which on CPU was about half
  of the call. `cb_prefix_matched_tokens` is the fewest prompt tokens the probe took from
  shared blocks over the rounds. A failure of the peer is reported as `cb_error` (its other
  fields None).
With `--out DIR` it writes DIR/ttft_sweep.png: TTFT against cached fraction, one panel per
prompt length, one line per tier and per peer.

Continuous batching, as found with transformers 5.23 on CPU:
- A request's complete blocks become shareable only once hashed, in `mark_complete_blocks`,
  which skips a request already FINISHED; one asking for a single token finishes in the step
  that completes its prefill, so its blocks are never hashed. With max_new_tokens=1 everywhere,
  `PagedAttentionCache.search_prefix_match` returned 0 for every request, across
  `generate_batch` calls and among prompts submitted together (those are prefilled in one
  forward, before any block is hashed, whatever max_new_tokens is). The seed therefore asks for
  2 tokens: then the probe matches exactly the cached prefix.
- transformers exposes no counter of matched tokens (no metric, attribute or output field);
  its only trace is a DEBUG record "Found a prefix match of N tokens ..." on the logger
  "ContinuousBatchingLogger", which a logging filter counts here while the peer runs.
- Pages default to 256 tokens, so a 128-token prefix could not be shared at all; the peer uses
  pages of `--block-size` tokens, as kvstore does. Its paged cache is sized for the rounds it
  runs (`num_blocks`): left to itself it fills most of the free RAM, tens of seconds on CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from typing import NamedTuple

import torch

from bench.cb_peer import PrefixMatchCounter, cb_config, counting_prefix_matches, greedy_config
from bench.ttft.point import TIERS, FirstTokenClock, full_kv, measure_point, print_table

CB_NAME = "transformers CB, block sharing"
SEED_NEW_TOKENS = 2  # a request must outlive its prefill step for its blocks to become shareable


def sweep_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Sweep grid: args.grid is [(prompt_tokens, cached_fraction, cached_tokens)]."""
    args.runs = 3 if args.runs is None else args.runs
    if args.codec != "none":
        p.error("--codec: the sweep runs codec none; run --codec without --sweep")
    default = "device,memory,lmdb" + (",redis" if args.redis_url else "")
    names = [t.strip() for t in (args.tier or default).split(",") if t.strip()]
    args.tiers = [t for t in names if t != "none"]
    for tier in args.tiers:
        if tier not in TIERS:
            p.error(f"--tier: unknown tier {tier!r}; choose from none,{','.join(TIERS)}")
    try:
        lengths = [int(n) for n in args.lengths.split(",") if n.strip()]
        fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    except ValueError as e:
        p.error(f"--lengths / --fractions: {e}")
    args.grid = []
    for n in lengths:
        for f in fractions:
            cached = round(f * n / args.block_size) * args.block_size
            if not 0 < cached < n:
                p.error(
                    f"fraction {f} of {n} tokens gives {cached} cached tokens; need 0 < c < {n}"
                )
            args.grid.append((n, f, cached))
    return args


def hf_generate_ttft(model, ids: list[int], runs: int) -> float:
    """Median time to the first token of HF `model.generate` (no prefix cache), 1 warm-up."""
    times = []
    with torch.inference_mode():
        for round_ in range(runs + 1):
            clock = FirstTokenClock()
            gc.collect()
            start = time.perf_counter()
            model.generate(
                torch.tensor([ids], device=model.device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
                max_new_tokens=1,
                do_sample=False,
                streamer=clock,
                pad_token_id=model.config.pad_token_id,
            )
            if round_:
                times.append(clock.first - start)
    return statistics.median(times)


class CBRound(NamedTuple):
    wall_s: float  # the probe's generate_batch call
    first_token_s: float  # from the call to the probe's token timestamp
    matched: int  # prompt tokens the probe took from shared blocks


class CBPeer:
    """One persistent continuous-batching manager for prompts of `n` tokens."""

    def __init__(self, model, n: int, block: int, rounds: int):
        self.model, self.n = model, n
        # room for every block the rounds hash, twice: a full cache evicts all cached blocks
        self.cb = cb_config(block, 4 * (rounds + 1) * (n // block + 2))
        self.gen = {new: greedy_config(model, new) for new in (1, SEED_NEW_TOKENS)}

    def generate(self, prompt: list[int], new_tokens: int, timestamps: bool = False):
        out = self.model.generate_batch(
            [prompt], self.gen[new_tokens], self.cb, record_timestamps=timestamps,
            persistent_manager=True, progress_bar=False,
        )  # fmt: skip
        results = list(out.values())
        if len(results) != 1 or results[0].error is not None:
            raise RuntimeError(f"{len(results)} results, errors: {[r.error for r in results]}")
        if len(results[0].generated_tokens) != new_tokens:
            raise RuntimeError(f"{len(results[0].generated_tokens)} tokens, not {new_tokens}")
        return results[0]

    def round(self, prefix: list[int], counter: PrefixMatchCounter, rng: random.Random) -> CBRound:
        """An untimed seed, then the timed probe."""
        fresh = self.n - len(prefix)
        self.generate(prefix + [rng.randrange(256) for _ in range(fresh)], SEED_NEW_TOKENS)
        probe = prefix + [rng.randrange(256) for _ in range(fresh)]
        counter.tokens = 0
        gc.collect()
        start = time.perf_counter()
        out = self.generate(probe, 1, timestamps=True)
        wall = time.perf_counter() - start
        return CBRound(wall, out.timestamps[0] - start, counter.tokens)


def cb_peer(model, ids: list[int], cached_points: list[int], args, rng: random.Random) -> dict:
    """{cached tokens: the point's CB fields}; a failure becomes `cb_error`, never hidden."""
    results: dict[int, dict] = {}
    try:
        peer = CBPeer(model, len(ids), args.block_size, args.runs * len(cached_points))
        with counting_prefix_matches() as counter:
            unrelated = [(t + 97) % 256 for t in reversed(ids)]
            peer.round(unrelated[: cached_points[0]], counter, rng)  # warm-up, excluded
            for cached in cached_points:
                rounds = [peer.round(ids[:cached], counter, rng) for _ in range(args.runs)]
                results[cached] = {
                    "ttft_cb_s": statistics.median(r.wall_s for r in rounds),
                    "ttft_cb_first_token_s": statistics.median(r.first_token_s for r in rounds),
                    "cb_prefix_matched_tokens": min(r.matched for r in rounds),
                }
    except Exception as e:  # reported in the output, never hidden
        error = {"ttft_cb_s": None, "ttft_cb_first_token_s": None, "cb_prefix_matched_tokens": None,
                 "cb_error": f"{CB_NAME}: {type(e).__name__}: {e}"}  # fmt: skip
        return {c: results.get(c, error) for c in cached_points}
    finally:
        model.destroy_cached_continuous_batching_manager()
    return results


def run_sweep(lm, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    rng = random.Random(0)
    points = []
    with tqdm(total=len(args.grid) * (len(args.tiers) + 1), desc="ttft sweep") as bar:
        for n in sorted({n for n, _, _ in args.grid}):
            ids = [rng.randrange(256) for _ in range(n)]
            kv = full_kv(lm.model, ids)
            hf_s = hf_generate_ttft(lm.model, ids, args.runs)
            grid = [(f, cached) for m, f, cached in args.grid if m == n]
            cb = cb_peer(lm.model, ids, [cached for _, cached in grid], args, rng)
            bar.update(len(grid))
            for tier in args.tiers:
                for fraction, cached in grid:
                    point = measure_point(lm, ids, kv, tier, cached, args, paired_device=False)
                    extra = {"cached_fraction": fraction, "ttft_hf_generate_s": hf_s}
                    points.append({**point, **extra, **cb[cached]})
                    bar.update(1)
    if args.out:
        plot_sweep(points, args.out)
    if args.json:
        print(json.dumps({"points": points}))
    else:
        print_sweep(points, args)
    return 0 if all(p["same_first_token"] for p in points) else 1


def print_sweep(points: list[dict], args: argparse.Namespace) -> None:
    def ms(key: str):
        return lambda p: "error" if p[key] is None else f"{p[key] * 1e3:.1f}"

    extra = [
        ("HF generate ms", ms("ttft_hf_generate_s")),
        ("CB ms", ms("ttft_cb_s")),
        ("CB 1st tok ms", ms("ttft_cb_first_token_s")),
        (
            "CB matched",
            lambda p: "-" if p["ttft_cb_s"] is None else str(p["cb_prefix_matched_tokens"]),
        ),
    ]
    print_table(points, args, extra)
    for error in dict.fromkeys(p["cb_error"] for p in points if "cb_error" in p):
        print(error)


def plot_sweep(points: list[dict], out_dir: str) -> str:
    """DIR/ttft_sweep.png: TTFT (ms) vs cached fraction, a panel per prompt length."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({p["prompt_tokens"] for p in points})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, n in zip(axes[0], lengths, strict=True):
        rows = [p for p in points if p["prompt_tokens"] == n]
        for label, xs, ys in sweep_lines(rows):
            ax.plot(xs, [y * 1e3 for y in ys], marker="o", label=label)
        ax.set(title=f"{n}-token prompt", xlabel="cached fraction", ylabel="TTFT (ms)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "ttft_sweep.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sweep_lines(rows: list[dict]) -> list[tuple[str, list[float], list[float]]]:
    """(label, cached fractions, TTFT s): none, HF generate, CB, ideal, then one per tier."""
    first = [p for p in rows if p["tier"] == rows[0]["tier"]]
    xs = [p["cached_fraction"] for p in first]
    cb = [p for p in first if p["ttft_cb_s"] is not None]
    cb_xs = [p["cached_fraction"] for p in cb]
    lines = [
        ("none (no cache)", xs, [p["ttft_nocache_s"] for p in first]),
        ("HF generate, no cache", xs, [p["ttft_hf_generate_s"] for p in first]),
        (CB_NAME, cb_xs, [p["ttft_cb_s"] for p in cb]),
        (CB_NAME + ", to its token", cb_xs, [p["ttft_cb_first_token_s"] for p in cb]),
        ("ideal (suffix only)", xs, [p["ttft_ideal_s"] for p in first]),
    ]
    for tier in dict.fromkeys(p["tier"] for p in rows):
        tier_rows = [p for p in rows if p["tier"] == tier]
        lines.append((tier, [p["cached_fraction"] for p in tier_rows],
                      [p["ttft_kvstore_s"] for p in tier_rows]))  # fmt: skip
    return lines
