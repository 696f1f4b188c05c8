"""The hit-rate report as a table: markdown, a rich table on the terminal, and a plot of
block hit rate against capacity."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.hitrate.plan_output import write_report

__all__ = ["COLUMNS", "markdown", "plot", "print_rows", "print_table", "summary", "write_outputs"]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _rows(report: dict[str, Any]) -> list[list[str]]:
    unique = report["unique_blocks"]
    return [
        [
            f"{r['capacity_blocks']:,} ({_pct(r['capacity_blocks'] / unique if unique else None)})",
            r["policy"],
            _pct(r["block_hit_rate"]),
            _pct(r["token_hit_rate"]),
            _pct(r["offline_block_hit_rate"]),
            _pct(r["optimal_block_hit_rate"]),
            "-" if r["ratio_to_offline"] is None else f"{r['ratio_to_offline']:.2f}",
            "-" if r["ratio_to_optimal"] is None else f"{r['ratio_to_optimal']:.2f}",
        ]
        for r in report["results"]
    ]


COLUMNS = (
    "capacity (of unique)",
    "policy",
    "block hit",
    "token hit",
    "offline ref",
    "upper bound",
    "/ offline",
    "/ upper",
)


def summary(report: dict[str, Any]) -> str:
    return (
        f"{report['workload']}: {report['requests']:,} requests, {report['block_refs']:,} block "
        f"references, {report['unique_blocks']:,} unique blocks of {report['block_tokens']} "
        f"tokens, mean input {report['mean_input_tokens']:,.0f} tokens; infinite-capacity "
        f"block hit rate {_pct(report['infinite_block_hit_rate'])}"
    )


def markdown(report: dict[str, Any]) -> str:
    lines = [summary(report), "", "| " + " | ".join(COLUMNS) + " |"]
    lines.append("|" + "|".join("---:" for _ in COLUMNS) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in _rows(report)]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Block hit rate vs capacity: one line per policy, both offline figures, infinite."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in results):
        rows = [r for r in results if r["policy"] == policy]
        ax.plot(
            [r["capacity_blocks"] for r in rows],
            [r["block_hit_rate"] for r in rows],
            "o-",
            label=policy,
        )
    first = [r for r in results if r["policy"] == results[0]["policy"]]
    caps = [r["capacity_blocks"] for r in first]
    ax.plot(caps, [r["offline_block_hit_rate"] for r in first], "k:", label="offline reference")
    ax.plot(caps, [r["optimal_block_hit_rate"] for r in first], "k--", label="upper bound")
    ax.axhline(report["infinite_block_hit_rate"], color="grey", lw=0.8, label="infinite")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("block hit rate")
    ax.set_title(report["workload"])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(report: dict[str, Any], out: Path) -> None:
    write_report(report, out, markdown(report), plot)


def print_table(report: dict[str, Any]) -> None:
    print_rows(summary(report), COLUMNS, _rows(report))


def print_rows(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
    """A table on the terminal (rich), every column right-aligned."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)
