"""The peer of `bench e2e`: transformers' continuous batching with block sharing, in its two
modes (bench/cb_peer.py runs one), each run on a fresh manager; see bench/e2e/__init__.py."""

from __future__ import annotations

import operator

from bench.cb_peer import (
    cb_config,
    counting_prefix_matches,
    greedy_config,
    pages_for,
    run_batch,
    serve_in_order,
)
from engine.contract import count_meeting_contract

PEER_NAME = "transformers continuous batching (allow_block_sharing)"
PEER_RUNS = {"batch": run_batch, "serving": serve_in_order}
PEER_MODES = tuple(PEER_RUNS)
REPEATED_MODES = ("serving",)  # batch mode is 6-13x slower: one run says as much


def run_peer(
    lm,
    prompts: list[list[int]],
    reference: list[list[int]],
    new_tokens: int,
    block: int,
    repeats: int,
    bar_cls,
) -> dict:
    """CB in both modes; the faster mode's best run is the peer's. `reference` holds HF
    `generate`'s outputs (for `same_outputs`)."""
    peer: dict = {"name": PEER_NAME, "page_size": block, "modes": {}}
    with counting_prefix_matches() as counter:
        for mode in PEER_MODES:
            runs = repeats if mode in REPEATED_MODES else 1
            with bar_cls(total=runs * len(prompts), desc=f"CB {mode}", leave=False) as bar:
                results = [
                    run_peer_mode(lm, prompts, new_tokens, block, mode, counter, bar)
                    for _ in range(runs)
                ]
            peer["modes"][mode] = best_peer_run(lm, prompts, results, reference, new_tokens)
    timed = [m for m in PEER_MODES if "total_s" in peer["modes"][m]]
    if not timed:
        errors = "; ".join(f"{m}: {peer['modes'][m]['error']}" for m in PEER_MODES)
        return {**peer, "error": errors}
    best = min(timed, key=lambda m: peer["modes"][m]["total_s"])
    fields = {k: peer["modes"][best][k] for k in ("total_s", "cb_prefix_matched_tokens")}
    return {**peer, "best_mode": best, **fields}


def best_peer_run(
    lm, prompts: list[list[int]], results: list[dict], reference: list[list[int]], new_tokens: int
) -> dict:
    """The fastest of a mode's runs with every run's time; the first error if any run failed."""
    if failed := [r for r in results if "error" in r]:
        return failed[0]
    best = dict(min(results, key=operator.itemgetter("total_s")))
    outputs = best.pop("outputs")
    best["same_outputs"] = sum(map(operator.eq, outputs, reference))
    best["contract_outputs"] = count_meeting_contract(lm, prompts, outputs, new_tokens)
    return {**best, "runs_s": [r["total_s"] for r in results]}


def run_peer_mode(lm, prompts, new_tokens: int, block: int, mode: str, counter, bar) -> dict:
    """One run of a mode on a fresh manager, after a warm-up on prompts of the same shape."""
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
    return {
        "total_s": total,
        "cb_prefix_matched_tokens": counter.tokens,
        "num_blocks": blocks,
        "outputs": outputs,
    }


def peer_cells(peer: dict) -> list[str]:
    """'s (matched tokens)' per CB mode, then kvstore's speedup over the faster mode."""
    modes = peer.get("modes", {})
    cells = [
        f"{modes[m]['total_s']:.2f} ({modes[m]['cb_prefix_matched_tokens']})"
        if "total_s" in modes.get(m, {})
        else "error"
        for m in PEER_MODES
    ]
    if "total_s" not in peer:
        return [*cells, "-"]
    return [*cells, f"{peer['kvstore_speedup_over_peer']:.2f}x ({peer['best_mode']})"]


def peer_errors(peer: dict) -> list[str]:
    if "modes" not in peer:
        return [peer["error"]]
    return [f"{m}: {r['error']}" for m, r in peer["modes"].items() if "error" in r]
