"""Figures of `bench load`: per level and server, then ratios across levels and servers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bench.load.client import ChatOutcome
from bench.load.runner import REPLACEMENT


def percentile_ms(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q) * 1e3) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def request_row(o: ChatOutcome) -> dict:
    return {
        "session": o.session,
        "turn": o.turn,
        "ok": o.ok,
        "status": o.status,
        "ttft_ms": None if o.ttft_s is None else o.ttft_s * 1e3,
        "latency_ms": o.latency_s * 1e3,
        "prompt_tokens": o.prompt_tokens,
        "cached_tokens": o.cached_tokens if o.cached_reported else None,
        "completion_tokens": o.completion_tokens,
        "text": o.text,
        "error": o.error or None,
    }


def summarize_level(
    outcomes: Sequence[ChatOutcome], wall_s: float, concurrency: int, sessions: int, turns: int
) -> dict:
    """One level on one server. Tokens and TTFT count successful requests only; the cached
    share is None unless every one of them reported cached_tokens."""
    ok = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    prompt = sum(o.prompt_tokens for o in ok)
    reported = bool(ok) and all(o.cached_reported for o in ok)
    cached = sum(o.cached_tokens for o in ok) if reported else None
    completion = sum(o.completion_tokens for o in ok)
    return {
        "concurrency": concurrency,
        "sessions": sessions,
        "requests_expected": sessions * turns,
        "requests_ok": len(ok),
        "requests_failed": len(failed),
        "requests_not_sent": sessions * turns - len(outcomes),  # turns after a failed one
        "first_error": failed[0].error if failed else None,
        "wall_s": wall_s,
        "completion_tokens": completion,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": ratio(cached, prompt) if cached is not None else None,
        "output_tok_per_s": completion / wall_s if wall_s else None,
        "req_per_s": len(ok) / wall_s if wall_s else None,
        "ttft_p50_ms": percentile_ms(ttfts, 50),
        "ttft_p90_ms": percentile_ms(ttfts, 90),
        "ttft_p99_ms": percentile_ms(ttfts, 99),
        "ttft_missing": len(ok) - len(ttfts),  # answers without any text
        "requests": [request_row(o) for o in sorted(outcomes, key=lambda o: (o.session, o.turn))],
    }


def texts(level: dict) -> dict[tuple[int, int], str]:
    return {(r["session"], r["turn"]): r["text"].rstrip(REPLACEMENT) for r in level["requests"]
            if r["ok"]}  # fmt: skip


def same_text(a: dict | None, b: dict | None) -> float | None:
    """Share of a's answered (session, turn) whose text b answered identically (but for a
    trailing U+FFFD, an incomplete UTF-8 tail only kvstore renders: bench.load.runner)."""
    if a is None or b is None or not (mine := texts(a)):
        return None
    theirs = texts(b)
    return sum(theirs.get(key) == text for key, text in mine.items()) / len(mine)


def by_concurrency(levels: Sequence[dict]) -> dict[int, dict]:
    return {level["concurrency"]: level for level in levels}


def add_scaling(levels: Sequence[dict]) -> None:
    """Each level against level 1 of the same server: tok/s and TTFT p50 ratios, same text."""
    base = by_concurrency(levels).get(1)
    for level in levels:
        level["tok_s_over_c1"] = ratio(level["output_tok_per_s"], base and base["output_tok_per_s"])
        level["ttft_p50_over_c1"] = ratio(level["ttft_p50_ms"], base and base["ttft_p50_ms"])
        level["same_text_vs_c1"] = same_text(base, level)


def compare(kvstore: Sequence[dict], peer: Sequence[dict]) -> list[dict]:
    """kvstore over the peer at each level both ran (> 1: kvstore has more tok/s, or a longer
    TTFT), and the share of kvstore's answers the peer gave identically."""
    theirs = by_concurrency(peer)
    return [
        {
            "concurrency": c,
            "tok_s_ratio_kvstore_over_peer": ratio(
                mine["output_tok_per_s"], other["output_tok_per_s"]
            ),
            "ttft_p50_ratio_kvstore_over_peer": ratio(mine["ttft_p50_ms"], other["ttft_p50_ms"]),
            "same_text_kvstore_vs_peer": same_text(mine, other),
        }
        for c, mine in by_concurrency(kvstore).items()
        if (other := theirs.get(c)) is not None
    ]


def finish(report: dict) -> dict:
    """Ratios over the measured levels; `same_text_c1_vs_c8` is kvstore's level 8 against its
    level 1 (None unless both ran)."""
    servers = report["servers"]
    for server in servers.values():
        add_scaling(server["levels"])
    kvstore = servers["kvstore"]["levels"]
    peer = servers.get("peer", {}).get("levels", [])
    report["comparison"] = compare(kvstore, peer)
    levels = by_concurrency(kvstore)
    report["same_text_c1_vs_c8"] = same_text(levels.get(1), levels.get(8))
    return report


def failures(report: dict, server: str = "kvstore") -> int:
    levels = report["servers"].get(server, {}).get("levels", [])
    return sum(lv["requests_failed"] + lv["requests_not_sent"] for lv in levels)
