"""`bench fleet`'s figures per run, its tables (kv against round-robin in each scenario) and
its plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.load.client import ChatOutcome
from bench.load.report import percentile_ms, ratio


def summarize(
    outcomes: Sequence[ChatOutcome], wall_s: float, tier_hits: dict, routed: list[int]
) -> dict:
    """One run. A failed request is `partial` when it had streamed text before its error (it
    cannot be retried transparently) and `lost` otherwise."""
    ok = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(tier_hits.values())
    mean = sum(routed) / len(routed) if routed else 0
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "partial": sum(1 for o in failed if o.text),
        "lost": sum(1 for o in failed if not o.text),
        "errors": sorted({o.error for o in failed if o.error})[:5],
        "wall_s": wall_s,
        "ttft_p50_ms": percentile_ms(ttfts, 50),
        "ttft_p90_ms": percentile_ms(ttfts, 90),
        "output_tok_per_s": sum(o.completion_tokens for o in ok) / wall_s if wall_s else None,
        "prompt_tokens": prompt,
        "cached_share": ratio(sum(o.cached_tokens for o in ok), prompt),
        "tier_tokens": tier_hits,
        "device_share": ratio(tier_hits.get("device", 0.0), cached),
        "requests_per_replica": routed,
        "max_over_mean": max(routed) / mean if mean else None,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def _row(run: dict) -> str:
    tiers = run["tier_tokens"]
    total = sum(tiers.values()) or 1.0
    shares = ", ".join(f"{t} {v / total:.0%}" for t, v in sorted(tiers.items()) if v)
    answered = f"{run['ok']}/{run['requests']}"
    return (
        f"| {run['scenario']} | {run['route']} | {answered} | {run['partial']} | "
        f"{run['lost']} | {_fmt(run['ttft_p50_ms'], '.0f')} | "
        f"{_fmt(run['ttft_p90_ms'], '.0f')} | {_fmt(run['output_tok_per_s'], '.1f')} | "
        f"{_fmt(run['cached_share'], '.1%')} | {shares or '-'} | "
        f"{run['requests_per_replica']} |"
    )


def print_report(report: dict) -> str:
    head = (
        "| scenario | route | answered | partial | lost | TTFT p50 ms | TTFT p90 ms | "
        "tok/s | cached | cached by tier | requests per replica |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"
    )
    lines = [head, *(_row(run) for run in report["runs"])]
    for scenario in ("private", "shared"):
        kv, rr = (_find(report, scenario, r) for r in ("kv", "round-robin"))
        if kv and rr:
            ttft = _ratio(kv["ttft_p50_ms"], rr["ttft_p50_ms"])
            device = _ratio(kv["device_share"], rr["device_share"])
            lines.append(
                f"\n{scenario}: kv / round-robin: TTFT p50 {ttft}, "
                f"device share of cached tokens {device}"
            )
    kv, device_only = (_find(report, "host-tiers", r) for r in ("kv", "kv-device"))
    if kv and device_only:
        ttft = _ratio(kv["ttft_p50_ms"], device_only["ttft_p50_ms"])
        cached = _ratio(kv["cached_share"], device_only["cached_share"])
        lines.append(f"\nhost-tiers: kv / kv-device: TTFT p50 {ttft}, cached share {cached}")
    return "\n".join(lines)


def _find(report: dict, scenario: str, route: str) -> dict | None:
    return next(
        (r for r in report["runs"] if (r["scenario"], r["route"]) == (scenario, route)), None
    )


def write_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    labels = [f"{r['scenario']}\n{r['route']}" for r in runs]
    x = range(len(runs))
    fig, ax = plt.subplots(figsize=(1.6 * len(runs) + 2, 4))
    ax.bar([i - 0.2 for i in x], [r["ttft_p50_ms"] or 0 for r in runs], 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [r["ttft_p90_ms"] or 0 for r in runs], 0.4, label="p90")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("bench fleet: kvstore router vs round-robin")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
