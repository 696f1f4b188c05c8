"""How predictable reuse is on a workload, and how much a policy could gain from predicting it.

    python -m bench predictability --workload {conversation,...,trace:PATH}
        --capacity-blocks 1%,3%,10% [--json]

Two questions, for the hit-rate aims of docs/POLICIES.md:

1. *How much would knowing whether content comes back be worth?* `whether` is LRU with an
   oracle: each entry is predicted to come back or not (its first block is, or is not,
   referenced by a later request) and predicted one-offs are evicted first, LRU within each
   class. The oracle is degraded to a true-positive rate `tpr` and a false-positive rate
   `fpr` (a deterministic coin per block and next reference), and each (tpr, fpr) is replayed
   on the real `RadixIndex` like `bench hitrate` and reported as a ratio to the offline
   reference. (1, 0) is the perfect oracle; (0, 0) is exactly LRU.
2. *How well can an online policy predict it?* For each request that adds blocks (its *run*),
   the label is whether the run's first block is referenced again, and the features are what
   a cache knows when it stores the run: the session's turn (1 + the turn of the chain it
   extends), blocks hit, blocks added, prompt tokens, the gap since the hit chain's last use
   and the arrival time. It reports each feature's AUC and that of a predictor fitted on the
   first half of the runs (the return rate of each bin of turn x gap quintile x blocks-added
   quartile, bin edges from that half too) and scored on the second half, with its
   true-positive rate at fixed false-positive rates. Runs that arrive in the last
   `CENSORED` of the trace's time are left out of these scores: there, "never comes back"
   mostly means the trace ended. This predictor is a coarse one, and a policy also knows an
   entry's age when it evicts, so its figures say how far these features go, not what any
   online policy can reach. The oracle is also replayed at the predictor's true-positive
   rate at a false-positive rate of 0.2 (a different unit: the predictor's rates are per
   run at its creation, the oracle's per prediction, at every use).
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from bench.hitrate import add_workload_arguments, parse_workload, replay
from bench.hitrate.offline import offline_leaf_hits
from bench.traces import BlockTrace
from kvstore.index import RadixIndex
from kvstore.index.policies import LRUPolicy

ORACLE_POINTS = ((1.0, 0.0), (1.0, 0.2), (0.9, 0.1), (0.8, 0.2), (0.5, 0.5), (0.0, 0.0))
FPR_LEVELS = (0.05, 0.1, 0.2, 0.3)
ACHIEVABLE_FPR = 0.2  # also replayed: an oracle as good as the held-out predictor here
CENSORED = 0.1  # the last tenth of the trace's time is not scored (labels cut by its end)
FEATURES = ("turn", "hit_blocks", "new_blocks", "prompt_tokens", "gap_ms", "arrival_ms")


class Runs(NamedTuple):
    """One row per request that adds blocks; features as float arrays, labels as bools."""

    features: dict[str, np.ndarray]
    returns: np.ndarray  # bool: the run's first block is referenced by a later request


def references(trace: BlockTrace) -> list[list[int]]:
    """Per block id, the sorted indices of the requests that reference it."""
    refs: list[list[int]] = [[] for _ in range(trace.num_unique)]
    per_request = np.repeat(np.arange(trace.num_requests), np.diff(trace.offsets))
    for block, r in zip(trace.blocks.tolist(), per_request.tolist(), strict=True):
        if not refs[block] or refs[block][-1] != r:
            refs[block].append(r)
    return refs


def find_runs(trace: BlockTrace, refs: list[list[int]]) -> Runs:
    """The runs of an unbounded prefix cache (ids name whole chains: a miss ends the hits)."""
    turn = np.zeros(trace.num_unique, dtype=np.int64)  # of the request that added the block
    last_ms = np.zeros(trace.num_unique)
    seen = np.zeros(trace.num_unique, dtype=bool)
    rows: list[tuple[float, ...]] = []
    labels: list[bool] = []
    for r in range(trace.num_requests):
        chain = trace.blocks[trace.offsets[r] : trace.offsets[r + 1]]
        hit = int(np.argmin(seen[chain])) if not seen[chain].all() else len(chain)
        now = float(trace.timestamps[r])
        prev = int(turn[chain[hit - 1]]) if hit else 0
        if hit < len(chain):
            gap = now - last_ms[chain[hit - 1]] if hit else -1.0
            row = (prev + 1, hit, len(chain) - hit, trace.num_tokens[r], gap, now)
            rows.append(tuple(map(float, row)))
            labels.append(refs[int(chain[hit])][-1] > r)
            turn[chain[hit:]] = prev + 1
        seen[chain] = True
        last_ms[chain] = now
    table = np.array(rows, dtype=float).reshape(-1, len(FEATURES))
    return Runs({f: table[:, i] for i, f in enumerate(FEATURES)}, np.array(labels, dtype=bool))


def auc(score: np.ndarray, label: np.ndarray) -> float | None:
    """Probability that a random positive scores above a random negative (ties count 1/2)."""
    pos, neg = int(label.sum()), int((~label).sum())
    if not pos or not neg:
        return None
    _, inverse, counts = np.unique(score, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    mid_rank = (ends - (counts - 1) / 2.0)[inverse]  # average 1-based rank of each tie group
    return float((mid_rank[label].sum() - pos * (pos + 1) / 2) / (pos * neg))


def _bins(runs: Runs, fit: np.ndarray) -> np.ndarray:
    """Bin of each run: turn (1..8+) x gap quintile (or no gap) x blocks-added quartile, the
    quantiles taken over the runs in `fit` (a boolean mask)."""
    f = runs.features
    gap, new = f["gap_ms"], f["new_blocks"]
    has_gap = gap >= 0
    fit_gap = gap[fit & has_gap]
    gap_edges = np.quantile(fit_gap, [0.2, 0.4, 0.6, 0.8]) if len(fit_gap) else np.zeros(0)
    new_edges = np.quantile(new[fit], [0.25, 0.5, 0.75]) if fit.any() else np.zeros(0)
    gap_bin = np.where(has_gap, np.searchsorted(gap_edges, gap) + 1, 0)
    new_bin = np.searchsorted(new_edges, new)
    return (np.minimum(f["turn"], 8).astype(np.int64) * 6 + gap_bin) * 4 + new_bin


def scored(runs: Runs) -> np.ndarray:
    """Mask of the runs whose labels count: those that arrive before the last CENSORED of
    the trace's time span."""
    arrival = runs.features["arrival_ms"]
    if not len(arrival):
        return np.zeros(0, dtype=bool)
    lo, hi = arrival.min(), arrival.max()
    return arrival <= hi - CENSORED * (hi - lo)


def held_out_score(runs: Runs) -> tuple[np.ndarray, np.ndarray]:
    """(score, label) of the scored runs in the second half, scored by the first half's
    return rate per bin (shrunk towards its overall rate by two pseudo-runs)."""
    label, keep = runs.returns, scored(runs)
    first = np.arange(len(label)) < len(label) // 2
    train = first & keep
    bins = _bins(runs, train)
    size = int(bins.max()) + 1 if len(bins) else 1
    returns = np.bincount(bins[train], weights=label[train], minlength=size)
    total = np.bincount(bins[train], minlength=size)
    prior = float(label[train].mean()) if train.any() else 0.0
    rate = (returns + 2 * prior) / (total + 2)
    test = ~first & keep
    return rate[bins[test]], label[test]


def tpr_at_fpr(score: np.ndarray, label: np.ndarray, fpr: float) -> float | None:
    """Best true-positive rate of a threshold on `score` whose false-positive rate <= fpr."""
    pos, neg = int(label.sum()), int((~label).sum())
    if not pos or not neg:
        return None
    order = np.argsort(-score, kind="stable")
    s, y = score[order], label[order]
    cut = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # last index of each score level
    tp, fp = np.cumsum(y)[cut], np.cumsum(~y)[cut]
    ok = fp / neg <= fpr + 1e-12
    return float(tp[ok].max() / pos) if ok.any() else 0.0


def _coin(tag: int, nxt: int) -> float:
    """A fixed uniform draw in [0, 1) per block and next reference (splitmix64's finalizer)."""
    z = (tag * 0x9E3779B97F4A7C15 + nxt + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) / 2**64


class WhetherOracle(LRUPolicy):
    """LRU within two classes; entries predicted never to come back are evicted first.

    An entry's content is its first block: a run inserted by request r from position p of
    its chain starts at chain_r[p]; a split moves the tail's start by the head's blocks (the
    index tells the policy of a split by a `resize` without a tag)."""

    def __init__(
        self, capacity: int, trace: BlockTrace, refs: list[list[int]], tpr: float, fpr: float
    ) -> None:
        super().__init__(capacity)
        self.trace, self.refs, self.tpr, self.fpr = trace, refs, tpr, fpr
        self.now = 0  # index of the request being served
        self._origin: dict[int, tuple[int, int]] = {}  # key -> (request, position of 1st block)

    def predicts_return(self, block: int) -> bool:
        refs = self.refs[block]
        nxt = bisect.bisect_right(refs, self.now)
        return _coin(block, nxt) < (self.tpr if nxt < len(refs) else self.fpr)

    def first_block(self, key: int) -> int:
        r, pos = self._origin[key]
        return int(self.trace.blocks[self.trace.offsets[r] + pos])

    def _class(self, key: int) -> int:
        return int(self.predicts_return(self.first_block(key)))

    def insert(self, key: int, size: int, tag: int | None = None, like: int | None = None) -> None:
        if like is not None:  # a split's head: the run's first blocks
            self._origin[key] = self._origin[like]
        else:
            chain = self.trace.request(self.now)
            pos = int(np.flatnonzero(chain == tag)[0]) if tag is not None else -1
            if pos < 0:
                raise ValueError("the whether oracle needs each run's tag (its first block id)")
            self._origin[key] = (self.now, pos)
        super().insert(key, size, tag, like)
        if like is None:
            self._entries[key].prio = (self._class(key), self._next_tick())

    def resize(self, key: int, size: int, tag: int | None = None) -> None:
        entry = self._entries[key]
        moved = entry.size - size
        super().resize(key, size, tag)
        if tag is None and moved > 0:  # a split: the head took the first `moved` blocks
            r, pos = self._origin[key]
            self._origin[key] = (r, pos + moved)
            self._reprioritize(key, entry, (self._class(key), entry.prio[1]))

    def remove(self, key: int, tag: int | None = None) -> None:
        super().remove(key, tag)
        del self._origin[key]

    def access(self, key: int) -> None:
        self._reprioritize(key, self._entries[key], (self._class(key), self._next_tick()))

    touch = access


def oracle_hits(
    trace: BlockTrace, refs: list[list[int]], capacity: int, tpr: float, fpr: float
) -> int:
    policy = WhetherOracle(capacity, trace, refs, tpr, fpr)

    def advance(r: int, hit: int, index: RadixIndex) -> None:
        policy.now = r + 1

    return replay(trace, policy, capacity, on_request=advance).block_hits


def prediction_report(trace: BlockTrace, refs: list[list[int]]) -> dict[str, Any]:
    runs = find_runs(trace, refs)
    keep = scored(runs)
    score, label = held_out_score(runs)
    features, returns = {f: v[keep] for f, v in runs.features.items()}, runs.returns[keep]
    return {
        "workload": trace.name,
        "runs": len(runs.returns),
        "runs_scored": int(keep.sum()),
        "return_rate": _rounded(float(returns.mean())) if len(returns) else None,
        "feature_auc": {f: _rounded(auc(v, returns)) for f, v in features.items()},
        "held_out_auc": _rounded(auc(score, label)),
        "held_out_tpr_at_fpr": {str(f): _rounded(tpr_at_fpr(score, label, f)) for f in FPR_LEVELS},
    }


def oracle_rows(
    trace: BlockTrace,
    refs: list[list[int]],
    capacities: Sequence[int],
    points: Sequence[tuple[float, float, bool]],
    bar: tqdm,
) -> list[dict]:
    """One row per capacity and (tpr, fpr, from the held-out predictor) point."""
    rows = []
    for capacity in capacities:
        offline = offline_leaf_hits(trace, capacity).block_hits
        for tpr, fpr, held_out in points:
            hits = oracle_hits(trace, refs, capacity, tpr, fpr)
            rows.append(
                {
                    "capacity_blocks": capacity,
                    "tpr": tpr,
                    "fpr": fpr,
                    "held_out": held_out,
                    "block_hit_rate": round(hits / trace.num_refs, 6) if trace.num_refs else 0.0,
                    "ratio_to_offline": _rounded(hits / offline if offline else None),
                }
            )
            bar.update(1)
    return rows


def run(
    trace: BlockTrace,
    capacities: Sequence[int],
    points: Sequence[tuple[float, float]] = ORACLE_POINTS,
    show_progress: bool = False,
) -> dict[str, Any]:
    """The prediction report, and the oracle at each point plus the held-out predictor's."""
    refs = references(trace)
    report = prediction_report(trace, refs)
    held = report["held_out_tpr_at_fpr"][str(ACHIEVABLE_FPR)]
    all_points = [(t, f, False) for t, f in points]
    all_points += [] if held is None else [(held, ACHIEVABLE_FPR, True)]
    total = len(capacities) * len(all_points)
    with tqdm(total=total, desc="oracle replays", disable=not show_progress) as bar:
        report["oracle"] = oracle_rows(trace, refs, capacities, all_points, bar)
    return report


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def markdown(report: dict[str, Any]) -> str:
    aucs = ", ".join(f"{k} {_fmt(v)}" for k, v in report["feature_auc"].items())
    tprs = ", ".join(f"{_fmt(v)} at {k}" for k, v in report["held_out_tpr_at_fpr"].items())
    lines = [
        f"{report['workload']}: {report['runs']:,} runs; of the {report['runs_scored']:,} "
        f"scored, {_fmt(report['return_rate'])} come back.",
        f"AUC per feature: {aucs}. Held-out predictor: AUC {_fmt(report['held_out_auc'])}, "
        f"true-positive rate {tprs} false-positive rate.",
        "",
        "| capacity | oracle tpr | oracle fpr | block hit | / offline |",
        "|---:|---:|---:|---:|---:|",
    ]
    for o in report["oracle"]:
        held = " (held-out predictor)" if o["held_out"] else ""
        lines.append(
            f"| {o['capacity_blocks']:,} | {o['tpr']:.2f}{held} | {o['fpr']:.2f} | "
            f"{100 * o['block_hit_rate']:.1f}% | {_fmt(o['ratio_to_offline'])} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _points(text: str) -> list[tuple[float, float]]:
    points = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        tpr, sep, fpr = item.partition(":")
        try:
            point = (float(tpr), float(fpr))
        except ValueError:
            raise ValueError(f"oracle point {item!r} is not TPR:FPR") from None
        if not sep or not all(0.0 <= p <= 1.0 for p in point):
            raise ValueError(f"oracle point {item!r}: TPR:FPR, each in [0, 1]")
        points.append(point)
    if not points:
        raise ValueError("give at least one oracle point")
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench predictability", description=__doc__)
    add_workload_arguments(parser)
    default_points = ",".join(f"{t:g}:{f:g}" for t, f in ORACLE_POINTS)
    parser.add_argument("--oracle", default=default_points, help="TPR:FPR points")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    trace, capacities = parse_workload(parser, args)
    try:
        points = _points(args.oracle)
    except ValueError as exc:
        parser.error(str(exc))
    report = run(trace, capacities, points, show_progress=not args.json)
    print(json.dumps(report) if args.json else markdown(report))
    return 0
