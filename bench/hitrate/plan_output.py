"""The capacity-planning report as a rich table, markdown and a plot."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.hitrate.tiers import TIERS

__all__ = ["markdown", "plot", "print_table", "write_outputs"]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _tiers_label(row: dict[str, Any]) -> str:
    caps = row["tier_capacity_blocks"]
    return ", ".join(f"{tier} {blocks:,}" for tier, blocks in caps.items())


def _tiers_used(report: dict[str, Any]) -> list[str]:
    used = {t for r in report["results"] for t in r["tier_capacity_blocks"]}
    return [t for t in TIERS if t in used]


def _has_cost(report: dict[str, Any]) -> bool:
    return "cost_model" in report


def _has_fleet(report: dict[str, Any]) -> bool:
    return any(r["replicas"] > 1 for r in report["results"])


def columns(report: dict[str, Any]) -> list[str]:
    cols = ["tiers per replica (blocks)", "policy", "replicas", "route"]
    cols += [f"{t} hit" for t in _tiers_used(report)]
    cols += ["block hit", "token hit", "upper bound"]
    cols += ["est TTFT s", "no cache s"] if _has_cost(report) else []
    return cols + (["requests per replica", "max/mean"] if _has_fleet(report) else [])


def _routed(row: dict[str, Any]) -> list[str]:
    ratio = row["routed_max_to_mean"]
    per_replica = "/".join(f"{n:,}" for n in row["requests_per_replica"])
    return [per_replica, "-" if ratio is None else f"{ratio:.2f}"]


def rows(report: dict[str, Any]) -> list[list[str]]:
    out = []
    for r in report["results"]:
        rates = r["tier_block_hit_rate"]
        cells = [_tiers_label(r), r["policy"], str(r["replicas"]), r["route"]]
        cells += [_pct(rates.get(t)) for t in _tiers_used(report)]
        cells += [_pct(r[k]) for k in ("block_hit_rate", "token_hit_rate")]
        cells.append(_pct(r["optimal_block_hit_rate"]))
        if _has_cost(report):
            cells += [f"{r['est_ttft_s']:.3f}", f"{r['est_ttft_nocache_s']:.3f}"]
        out.append(cells + (_routed(r) if _has_fleet(report) else []))
    return out


def summary(report: dict[str, Any]) -> str:
    text = (
        f"{report['workload']}: {report['requests']:,} requests, {report['block_refs']:,} block "
        f"references, {report['unique_blocks']:,} unique blocks of {report['block_tokens']} "
        f"tokens; infinite-capacity block hit rate {_pct(report['infinite_block_hit_rate'])}"
    )
    if _has_cost(report):
        cost = report["cost_model"]
        loads = ", ".join(f"{t} {ms:g}" for t, ms in cost["load_ms_per_block"].items())
        text += f"; prefill {cost['prefill_ms_per_token']:g} ms/token, load ms/block: {loads}"
    kv = next((r for r in report["results"] if r.get("routing")), None)
    if kv is not None:
        w, service = kv["routing"], kv["service_model"]
        text += (
            f"; kv route: prefill weight {w['prefill_weight']:g}, decode weight "
            f"{w['decode_weight']:g}, block load host {w['host_block_cost']:g} / disk "
            f"{w['disk_block_cost']:g} / redis {w['redis_block_cost']:g} of its prefill, "
            f"service {service['prefill_ms_per_token']:g} ms per "
            f"uncached prompt token + {service['decode_ms_per_token']:g} per output token"
        )
    return text


def markdown(report: dict[str, Any]) -> str:
    cols = columns(report)
    lines = [summary(report), "", "| " + " | ".join(cols) + " |"]
    lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(cols))) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in rows(report)]
    return "\n".join(lines) + "\n"


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=summary(report))
    for i, col in enumerate(columns(report)):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows(report):
        table.add_row(*row)
    Console().print(table)


def _groups(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Rows by their tiers (names), route and policy; a one-replica row, the same under every
    route, joins each route's group."""
    results = report["results"]
    routes = list(dict.fromkeys(r["route"] for r in results if r["replicas"] > 1))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        tiers = " + ".join(r["tier_capacity_blocks"])
        for route in routes if r["replicas"] == 1 and routes else [r["route"]]:
            groups.setdefault(f"{tiers}; {route}; {r['policy']}", []).append(r)
    return groups


def _draw(axes: list[Any], label: str, group: list[dict[str, Any]], color: str) -> None:
    group = sorted(group, key=lambda r: r["capacity_blocks"])
    x = [r["capacity_blocks"] for r in group]
    axes[0].plot(x, [r["block_hit_rate"] for r in group], "o-", color=color, label=label)
    axes[0].plot(x, [r["tier_block_hit_rate"][TIERS[0]] for r in group], ":", color=color)
    if len(axes) > 1:
        axes[1].plot(x, [r["est_ttft_s"] for r in group], "o-", color=color, label=label)
    if any(r["replicas"] > 1 for r in group):
        for r, xi in zip(group, x, strict=True):
            axes[0].annotate(f"{r['replicas']}x", (xi, r["block_hit_rate"]), fontsize=7)


def plot(report: dict[str, Any], path: Path) -> None:
    """Total and device block hit rate (and estimated TTFT) against the fleet's blocks, one
    line per tier hierarchy, route and policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if _has_cost(report) else 1
    fig, grid = plt.subplots(1, panels, figsize=(7 * panels, 4.8), squeeze=False)
    axes = list(grid[0])
    for i, (label, group) in enumerate(_groups(report).items()):
        _draw(axes, label, group, f"C{i % 10}")
    axes[0].axhline(report["infinite_block_hit_rate"], color="grey", lw=0.8, label="infinite")
    axes[0].set_ylabel("block hit rate (solid: all tiers, dotted: device)")
    if panels == 2:
        nocache = report["results"][0]["est_ttft_nocache_s"]
        axes[1].axhline(nocache, color="grey", lw=0.8, label="no cache")
        axes[1].set_ylabel("estimated mean TTFT (s)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("blocks in every tier of the fleet")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(report["workload"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(report: dict[str, Any], out: Path) -> None:
    write_report(report, out, markdown(report), plot)


def write_report(
    report: dict[str, Any], out: Path, table: str, plot_to: Callable[[dict, Path], None]
) -> None:
    """hitrate.json, hitrate.md (`table`) and hitrate.png (`plot_to`) under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "hitrate.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "hitrate.md").write_text(table)
    plot_to(report, out / "hitrate.png")
