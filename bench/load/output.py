"""`bench load` output: rich tables on stdout, and load.json, load.md and load.png in --out."""

from __future__ import annotations

import json
from pathlib import Path

LEVEL_COLUMNS = ("server", "c", "sessions", "ok", "failed", "tok/s", "req/s", "TTFT p50",
                 "p90", "p99", "cached", "tok/s÷c1", "p50÷c1", "same÷c1")  # fmt: skip
COMPARE_COLUMNS = ("c", "tok/s kvstore÷peer", "TTFT p50 kvstore÷peer", "same text")
LEGEND = ("TTFT in ms (client side, to the first text); cached: sum cached_tokens / sum "
          "prompt_tokens; ÷c1: ratio to the same server's level 1; same: share of (session, "
          "turn) answers identical to level 1's (kvstore÷peer table: to kvstore's)")  # fmt: skip


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def level_rows(report: dict) -> list[list[str]]:
    rows = []
    for name, server in report["servers"].items():
        for lv in server["levels"]:
            failed = lv["requests_failed"] + lv["requests_not_sent"]
            rows.append([name, str(lv["concurrency"]), str(lv["sessions"]), str(lv["requests_ok"]),
                         str(failed), fmt(lv["output_tok_per_s"]), fmt(lv["req_per_s"], ".2f"),
                         fmt(lv["ttft_p50_ms"]), fmt(lv["ttft_p90_ms"]), fmt(lv["ttft_p99_ms"]),
                         fmt(lv["cached_share"], ".1%"), fmt(lv["tok_s_over_c1"], ".2f"),
                         fmt(lv["ttft_p50_over_c1"], ".2f"),
                         fmt(lv["same_text_vs_c1"], ".0%")])  # fmt: skip
    return rows


def compare_rows(report: dict) -> list[list[str]]:
    return [
        [str(row["concurrency"]), fmt(row["tok_s_ratio_kvstore_over_peer"], ".2f"),
         fmt(row["ttft_p50_ratio_kvstore_over_peer"], ".2f"),
         fmt(row["same_text_kvstore_vs_peer"], ".0%")]
        for row in report["comparison"]
    ]  # fmt: skip


def notes(report: dict) -> list[str]:
    config = report["config"]
    out = [
        LEGEND,
        f"{config['turns']} turns x {config['max_tokens']} tokens per session, "
        f"max({config['sessions']}, c) sessions at level c, {config['system_prompt_bytes']}-byte "
        f"system prompt, model {config['model']}",
        f"same_text_c1_vs_c8 (kvstore): {fmt(report['same_text_c1_vs_c8'], '.0%')}",
    ]
    for name, server in report["servers"].items():
        restart = "restarted per level" if server["restarted_per_level"] else "one server"
        out.append(f"{name}: {server['label']} ({restart})")
        if server.get("error"):
            out.append(f"{name} error: {server['error']}")
        for lv in server["levels"]:
            if lv["first_error"]:
                out.append(f"{name} c={lv['concurrency']} first error: {lv['first_error']}")
    return out


def print_tables(report: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # a file or pipe: room for every column
        console = Console(width=max(console.width, 140))
    for title, columns, rows in [
        ("bench load: closed-loop multi-turn chat", LEVEL_COLUMNS, level_rows(report)),
        ("kvstore vs peer, per level", COMPARE_COLUMNS, compare_rows(report)),
    ]:
        if not rows:
            continue
        table = Table(title=title, box=box.SIMPLE_HEAD)
        for i, column in enumerate(columns):
            table.add_column(
                column, justify="left" if i == 0 and columns[0] == "server" else "right"
            )
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for line in notes(report):
        console.print(line, markup=False, highlight=False)


def markdown_table(columns: tuple[str, ...], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def markdown(report: dict) -> str:
    parts = ["# bench load", "", markdown_table(LEVEL_COLUMNS, level_rows(report)), ""]
    if report["comparison"]:
        parts += [markdown_table(COMPARE_COLUMNS, compare_rows(report)), ""]
    return "\n".join(parts + [f"- {line}" for line in notes(report)]) + "\n"


def plot(report: dict, path: Path) -> None:
    """tok/s and TTFT p50 against concurrency, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    servers = report["servers"].values()
    levels_run = sorted({lv["concurrency"] for server in servers for lv in server["levels"]})
    for name, server in report["servers"].items():
        levels = [lv for lv in server["levels"] if lv["requests_ok"]]
        cs = [lv["concurrency"] for lv in levels]
        left.plot(cs, [lv["output_tok_per_s"] for lv in levels], marker="o", label=name)
        right.plot(cs, [lv["ttft_p50_ms"] for lv in levels], marker="o", label=name)
    for ax, label in ((left, "output tok/s"), (right, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels_run, [str(c) for c in levels_run])
        ax.set_xlabel("concurrency (closed-loop sessions in flight)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    right.set_yscale("log")
    fig.suptitle("bench load: multi-turn chat under concurrent load")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "load.json").write_text(json.dumps(report, indent=1))
    (out_dir / "load.md").write_text(markdown(report))
    plot(report, out_dir / "load.png")
