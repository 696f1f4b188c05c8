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
   and the arrival time. It reports each feature's AUC and that of a predictor trained on the
   first half of the runs (the empirical return rate of each bin of turn x gap x blocks
   added) and scored on the second half, with its true-positive rate at fixed false-positive
   rates. An online policy cannot predict better than a predictor fitted to the trace's own
   labels with these features, unless it has information the trace does not record. The
   oracle is also replayed at that predictor's rates at a false-positive rate of 0.2.
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
from bench.offline import offline_leaf_hits
from bench.traces import BlockTrace
from kvstore.policy import LRUPolicy

ORACLE_POINTS = ((1.0, 0.0), (1.0, 0.2), (0.9, 0.1), (0.8, 0.2), (0.5, 0.5), (0.0, 0.0))
FPR_LEVELS = (0.05, 0.1, 0.2, 0.3)
ACHIEVABLE_FPR = 0.2  # also replayed: an oracle as good as the held-out predictor here
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


def runs(trace: BlockTrace, refs: list[list[int]]) -> Runs:
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


def _bins(runs: Runs) -> np.ndarray:
    """Bin of each run: turn (1..8+) x gap quintile (or no gap) x blocks-added quartile."""
    f = runs.features
    gap = f["gap_ms"]
    has_gap = gap >= 0
    gap_edges = np.quantile(gap[has_gap], [0.2, 0.4, 0.6, 0.8]) if has_gap.any() else []
    gap_bin = np.where(has_gap, np.searchsorted(gap_edges, gap) + 1, 0)
    new_bin = np.searchsorted(np.quantile(f["new_blocks"], [0.25, 0.5, 0.75]), f["new_blocks"])
    return (np.minimum(f["turn"], 8).astype(np.int64) * 6 + gap_bin) * 4 + new_bin


def held_out_score(runs: Runs) -> tuple[np.ndarray, np.ndarray]:
    """(score, label) of the second half, scored by the first half's return rate per bin
    (shrunk towards the overall rate by two pseudo-runs)."""
    bins, label = _bins(runs), runs.returns
    half = len(label) // 2
    size = int(bins.max()) + 1 if len(bins) else 1
    returns = np.bincount(bins[:half], weights=label[:half], minlength=size)
    total = np.bincount(bins[:half], minlength=size)
    prior = float(label[:half].mean()) if half else 0.0
    rate = (returns + 2 * prior) / (total + 2)
    return rate[bins[half:]], label[half:]


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


class WhetherOracle(LRUPolicy):
    """LRU within two classes; entries predicted never to come back are evicted first."""

    def __init__(self, capacity: int, refs: list[list[int]], tpr: float, fpr: float):
        super().__init__(capacity)
        self.refs, self.tpr, self.fpr = refs, tpr, fpr
        self.now = 0  # index of the request being served
        self._tags: dict[int, int] = {}

    def predicts_return(self, tag: int) -> bool:
        refs = self.refs[tag]
        nxt = bisect.bisect_right(refs, self.now)
        coin = (tag * 0x9E3779B1 + nxt * 0x85EBCA77 + 0x165667B1) % 2**32 / 2**32
        return coin < (self.tpr if nxt < len(refs) else self.fpr)

    def _priority(self, key: int) -> tuple[int, int]:
        return int(self.predicts_return(self._tags[key])), self._next_tick()

    def insert(self, key: int, size: int, tag: int | None = None, like: int | None = None) -> None:
        if tag is None:
            raise ValueError("the whether oracle needs each run's tag (its first block id)")
        self._tags[key] = tag
        super().insert(key, size, tag, like)
        if like is None:
            self._entries[key].prio = self._priority(key)

    def remove(self, key: int, tag: int | None = None) -> None:
        super().remove(key, tag)
        del self._tags[key]

    def access(self, key: int) -> None:
        self._reprioritize(key, self._entries[key], self._priority(key))

    touch = access


def oracle_hits(trace: BlockTrace, refs: list[list[int]], capacity: int, tpr: float,
                fpr: float) -> int:  # fmt: skip
    policy = WhetherOracle(capacity, refs, tpr, fpr)

    def advance(r: int, hit: int, index: object) -> None:
        policy.now = r + 1

    return replay(trace, policy, capacity, on_request=advance).block_hits


def run(trace: BlockTrace, capacities: Sequence[int],
        points: Sequence[tuple[float, float]] = ORACLE_POINTS, show_progress: bool = False,
        ) -> dict[str, Any]:  # fmt: skip
    refs = references(trace)
    found = runs(trace, refs)
    score, label = held_out_score(found)
    report: dict[str, Any] = {
        "workload": trace.name,
        "runs": len(found.returns),
        "return_rate": round(float(found.returns.mean()), 4) if len(found.returns) else None,
        "feature_auc": {f: _rounded(auc(v, found.returns)) for f, v in found.features.items()},
        "held_out_auc": _rounded(auc(score, label)),
        "held_out_tpr_at_fpr": {str(f): _rounded(tpr_at_fpr(score, label, f)) for f in FPR_LEVELS},
        "oracle": [],
    }
    # the held-out predictor's operating point at FPR 0.2, as an oracle with those rates
    held = report["held_out_tpr_at_fpr"][str(ACHIEVABLE_FPR)]
    extra = [] if held is None else [(held, ACHIEVABLE_FPR)]
    jobs = [(c, t, f) for c in capacities for t, f in [*points, *extra]]
    for capacity, tpr, fpr in tqdm(jobs, desc="oracle replays", disable=not show_progress):
        offline = offline_leaf_hits(trace, capacity).block_hits
        hits = oracle_hits(trace, refs, capacity, tpr, fpr)
        report["oracle"].append({
            "capacity_blocks": capacity, "tpr": tpr, "fpr": fpr,
            "block_hit_rate": round(hits / trace.num_refs, 6) if trace.num_refs else 0.0,
            "ratio_to_offline": _rounded(hits / offline if offline else None),
            "held_out": (tpr, fpr) in extra,
        })  # fmt: skip
    return report


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def markdown(report: dict[str, Any]) -> str:
    aucs = ", ".join(f"{k} {_fmt(v)}" for k, v in report["feature_auc"].items())
    tprs = ", ".join(f"{_fmt(v)} at {k}" for k, v in report["held_out_tpr_at_fpr"].items())
    lines = [
        f"{report['workload']}: {report['runs']:,} runs, {_fmt(report['return_rate'])} come back.",
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
