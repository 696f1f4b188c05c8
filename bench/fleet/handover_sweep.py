"""`bench fleet --scenarios handover-sweep`: what a hand-over costs and saves at each prompt
length, on an idle prefill replica and decode replica sharing a Redis (each pinned to a core
of its own); the measurement behind `kvstore router --handover-min-tokens`.

For each length N of `--sweep-tokens` (a prompt of fresh token ids, one answer token, the
median of `--sweep-reps`):
- `direct`: the decode replica computes the prompt itself: that long, its running decodes
  wait;
- `decode side`: the decode replica takes the hand-over (loads the prompt from Redis): that
  long they wait instead;
- `handed over`: the prefill step plus the decode side: the request's time to first token.
A hand-over pays from the length where the decode time it saves (direct - decode side) is
at least the time it adds to the request (handed over - direct): `break_even_tokens`. The
suggested threshold is the shortest length past that where the added time is at most
`MAX_ADDED_SHARE` of the prompt's own prefill (direct): `suggested_min_tokens`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.fleet.cluster import Fleet, FleetSpec

SWEEP_SEED = 23
MAX_ADDED_SHARE = 0.25


def _post(client: httpx.Client, url: str, ids: list[int], headers: dict | None = None) -> float:
    """Seconds for one completion of one token; RuntimeError if it fails."""
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    answer = client.post(f"{url}/v1/completions", json=body, headers=headers or {})
    took = time.perf_counter() - start
    if answer.status_code != 200:
        raise RuntimeError(f"{url} answered {answer.status_code}: {answer.text[:200]}")
    return took


def measure(client: httpx.Client, fleet: Fleet, n: int, rep: int, seed: int) -> dict[str, float]:
    """One repetition at length n: fresh prompts for each path (nothing cached)."""
    prefill, decode = fleet.replicas[0].url, fleet.replicas[1].url
    rng = np.random.default_rng([seed, SWEEP_SEED, n, rep])
    direct_ids, handed_ids = (rng.integers(1, 200, n).tolist() for _ in range(2))
    direct = _post(client, decode, direct_ids)
    prefill_s = _post(client, prefill, handed_ids)
    decode_s = _post(client, decode, handed_ids, {"x-kvstore-handover": "0"})
    return {"direct": direct, "decode_side": decode_s, "handed_over": prefill_s + decode_s}


def run_sweep(args: argparse.Namespace, model_dir: Path, base: Path) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="handover-sweep-", dir=base))
    spec = FleetSpec(
        model_dir=model_dir, replicas=2, device_blocks=args.device_blocks, shared=True,
        route="kv", workdir=workdir, roles=("prefill", "decode"), pin_cores=True,
    )  # fmt: skip
    rows = []
    with Fleet(spec) as fleet, httpx.Client(timeout=args.timeout) as client:
        measure(client, fleet, 64, 1000, args.seed)  # first forwards, not measured
        for n in (int(t) for t in args.sweep_tokens.split(",")):
            reps = [measure(client, fleet, n, r, args.seed) for r in range(args.sweep_reps)]
            row = {k: float(np.median([r[k] for r in reps])) * 1e3 for k in reps[0]}
            rows.append({"tokens": n, **row})
    return {"scenario": "handover-sweep", **judge(rows)}


def judge(rows: list[dict]) -> dict:
    """Each row (tokens; direct, decode_side and handed_over ms) with what a hand-over saves
    and adds, the break-even length and the suggested threshold (module docstring)."""
    rows = [r | {"saved_ms": r["direct"] - r["decode_side"],
                 "added_ms": r["handed_over"] - r["direct"]} for r in rows]  # fmt: skip
    pays = [r for r in rows if r["saved_ms"] >= r["added_ms"]]
    cheap = [r for r in pays if r["added_ms"] <= MAX_ADDED_SHARE * r["direct"]]
    return {
        "rows": rows,
        "break_even_tokens": min((r["tokens"] for r in pays), default=None),
        "suggested_min_tokens": min((r["tokens"] for r in cheap), default=None),
    }


def print_sweep(sweep: dict | None) -> str:
    if sweep is None:
        return ""
    lines = ["| prompt tokens | direct ms | decode side ms | handed over ms | decode time "
             "saved ms | latency added ms |", "|" + "---:|" * 6]  # fmt: skip
    for r in sweep["rows"]:
        lines.append(
            f"| {r['tokens']} | {r['direct']:.1f} | {r['decode_side']:.1f} | "
            f"{r['handed_over']:.1f} | {r['saved_ms']:.1f} | {r['added_ms']:.1f} |"
        )
    lines.append(f"\nhand-over pays from {sweep['break_even_tokens']} tokens; adds at most "
                 f"{MAX_ADDED_SHARE:.0%} of the prompt's prefill from "
                 f"{sweep['suggested_min_tokens']} tokens")  # fmt: skip
    return "\n".join(lines)


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep-tokens", default="32,64,128,256,512,1024,2048",
                        help="handover-sweep: prompt lengths")  # fmt: skip
    parser.add_argument("--sweep-reps", type=int, default=5, help="handover-sweep: repetitions")
