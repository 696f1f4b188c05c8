"""`python -m bench <name> [args]`: each benchmark is a module `bench.<name>` with `main(argv)`."""

from __future__ import annotations

import difflib
import importlib
import sys

from engine.extras import as_missing_extra

BENCHMARKS = {
    "codecs": "tier payload codecs: stored size, encode/decode speed, logit change (tiny model)",
    "kvquant": "int8/fp8 tier codecs on SmolLM2: perplexity, greedy agreement, logit change",
    "hitrate": "block and token hit rate per eviction policy vs Belady bounds, per capacity",
    "predictability": "how well reuse can be predicted, and what predicting it would be worth",
    "micro": "hash + match + insert cost per block and index bytes per block, 1e4..1e6 blocks",
    "ttft": "TTFT per tier as a ratio to the ideal suffix-only prefill",
    "e2e": "workload end to end: engine (device tier) vs no cache vs HF continuous batching",
    "io": "tier bandwidth as a ratio to a baseline moving the same bytes",
    "faults": "fault injection: corruption, collisions, outages, full disks, tenants, leaks",
    "serve": "load on `kvstore serve` replicas: client-side TTFT p50/p99 and reported hit rate",
    "load": "multi-turn chat at rising concurrency: kvstore serve vs transformers serve (CB)",
    "fleet": "replicas behind kvstore router vs round-robin: TTFT, tiers, a replica killed",
    "nsample": "parallel sampling: n sequences of one prompt against one, side by side",
    "contention": "engine steps and the demo quiet vs beside busy processes, per threading",
    "windows": "device blocks a running request holds as decode passes a sliding window",
    "loglik": "harness-like prompt logprobs (echo, max_tokens 0) sharing a context: cache vs none",
    "step": "host work per decode step (µs, torch ops) on the micro model beside transformers CB",
    "gpu": "the prepared run for a GPU machine: CUDA tests, ttft, load, e2e, step; JSON + table",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] not in BENCHMARKS and argv[0] not in ("-h", "--help"):
        close = difflib.get_close_matches(argv[0], BENCHMARKS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        names = ", ".join(BENCHMARKS)
        print(f"python -m bench: error: unknown benchmark {argv[0]!r}{hint} (one of: {names})",
              file=sys.stderr)  # fmt: skip
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m bench {" + ",".join(BENCHMARKS) + "} [args]\n")
        for name, text in BENCHMARKS.items():
            print(f"  {name:8s} {text}")
        return 0 if argv else 2
    try:
        module = importlib.import_module(f"bench.{argv[0]}")
        return int(module.main(argv[1:]) or 0)
    except ImportError as e:  # an extra that is not installed: one line saying which
        missing = as_missing_extra(e)
        if missing is None:
            raise
        print(f"python -m bench {argv[0]}: error: {missing}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
