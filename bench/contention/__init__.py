"""`python -m bench contention`: how the engine degrades when other processes keep the cores
busy (a shared serving host, a CI runner).

Two parts, each side by side in one run:
- steps: prefill time (one prompt) and decode time per step (a batch of requests) of the
  engine at each threading choice, quiet and then beside `--busy` CPU-bound processes; each
  repeat of a choice runs in a process of its own (libgomp reads its environment once),
  which measures both, so a pair shares its process, its warm-up and its memory;
- demo: `kvstore demo` (`--demo-model`, its default smollm2) at its defaults, quiet then
  busy, `--pairs` times; the ratio of each pair and their median.
The ratios are what to compare: absolute times drift with the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

# threading choice -> (--threads of the worker, extra environment)
CHOICES = {
    "auto (default)": ("auto", {}),
    "2 threads": ("2", {}),
    "2 threads, passive wait": ("2", {"OMP_WAIT_POLICY": "PASSIVE"}),
    "1 thread": ("1", {}),
}
# seconds of load before a busy measurement: a few of the adaptive team's intervals
# (engine/loop/threads.py), so the measurement is of a host that is busy, not of the moment
# it became busy
SETTLE_S = 1.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench contention", description=__doc__)
    p.add_argument("--model", default="tiny", help="tiny, smollm2, a .gguf file or a directory")
    p.add_argument("--demo-model", default="smollm2", help="the demo's model (its default)")
    p.add_argument("--busy", type=int, default=2, help="CPU-bound processes beside it")
    p.add_argument("--pairs", type=int, default=3, help="quiet/busy demo pairs (0: none)")
    p.add_argument("--repeats", type=int, default=2, help="step measurements per choice")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-batch", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


@contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """`n` CPU-bound shell loops while the block runs."""
    procs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def step_times(args: argparse.Namespace, threads: str, env: dict[str, str]) -> dict[str, dict]:
    """{"quiet": ..., "busy": ...}: prefill and decode times of one fresh worker process
    (bench.contention.worker), measured quiet, then beside `--busy` processes."""
    sizes = {"--prompt-tokens": args.prompt_tokens, "--decode-batch": args.decode_batch,
             "--decode-tokens": args.decode_tokens}  # fmt: skip
    cmd = [sys.executable, "-m", "bench.contention.worker", "--model", args.model]
    cmd += ["--threads", threads, *(str(x) for kv in sizes.items() for x in kv)]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    with subprocess.Popen(cmd, env=os.environ | env, **pipes) as worker:
        try:
            expect_line(worker, "ready")
            quiet = measure_once(worker)
            with busy_processes(args.busy):
                time.sleep(SETTLE_S)  # what a process starting beside the load would see
                busy = measure_once(worker)
        finally:
            with contextlib.suppress(BrokenPipeError):  # a worker that died: said above
                worker.stdin.close()  # type: ignore[union-attr]
    if worker.returncode:
        raise RuntimeError(f"the contention worker exited with {worker.returncode}")
    return {"quiet": quiet, "busy": busy}


def expect_line(worker: subprocess.Popen, want: str | None = None) -> str:
    line = worker.stdout.readline().strip()  # type: ignore[union-attr]
    if not line or (want is not None and line != want):
        worker.kill()
        raise RuntimeError(f"the contention worker said {line!r} (exit {worker.wait()})")
    return line


def measure_once(worker: subprocess.Popen) -> dict:
    try:
        worker.stdin.write("measure\n")  # type: ignore[union-attr]
        worker.stdin.flush()  # type: ignore[union-attr]
    except BrokenPipeError:
        raise RuntimeError(f"the contention worker exited with {worker.wait()}") from None
    return json.loads(expect_line(worker))


def demo_time(model: str) -> float:
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "engine.cli", "demo", "--model", model, "--json"]
    subprocess.run(cmd, capture_output=True, check=True)
    return time.perf_counter() - start


def measure_steps(args: argparse.Namespace) -> dict[str, dict[str, list[dict]]]:
    """choice -> {"quiet": [...], "busy": [...]}: the pairs interleaved, quiet first."""
    out: dict[str, dict[str, list[dict]]] = {c: {"quiet": [], "busy": []} for c in CHOICES}
    runs = [(c, r) for r in range(args.repeats) for c in CHOICES]
    for choice, _ in tqdm(runs, desc="step pairs", unit="pair", file=sys.stderr):
        pair = step_times(args, *CHOICES[choice])
        for key in ("quiet", "busy"):
            out[choice][key].append(pair[key])
    return out


def measure_demo(args: argparse.Namespace) -> list[tuple[float, float]]:
    pairs = []
    for _ in tqdm(range(args.pairs), desc="demo pairs", unit="pair", file=sys.stderr):
        quiet = demo_time(args.demo_model)
        with busy_processes(args.busy):
            pairs.append((quiet, demo_time(args.demo_model)))
    return pairs


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def step_table(steps: dict, busy: int) -> Table:
    table = Table(title=f"engine steps, quiet and beside {busy} busy processes (medians)")
    for col in ("threading", "prefill ms", "busy", "x", "decode ms/step", "busy", "x"):
        table.add_column(col, justify="left" if col == "threading" else "right")
    base = steps["auto (default)"]["quiet"]
    for choice, runs in steps.items():
        cells = [choice]
        for key in ("prefill_s", "decode_step_s"):
            quiet, loaded = med(runs["quiet"], key), med(runs["busy"], key)
            cells += [f"{quiet * 1e3:.1f}", f"{loaded * 1e3:.1f}", f"{loaded / med(base, key):.2f}"]
        table.add_row(*cells)
    return table


def demo_table(pairs: list[tuple[float, float]], busy: int, model: str) -> Table:
    table = Table(title=f"kvstore demo --model {model}, quiet then beside {busy} busy processes")
    for col in ("pair", "quiet s", "busy s", "busy / quiet"):
        table.add_column(col, justify="right")
    for i, (quiet, loaded) in enumerate(pairs, 1):
        table.add_row(str(i), f"{quiet:.1f}", f"{loaded:.1f}", f"{loaded / quiet:.2f}")
    ratio = statistics.median(b / q for q, b in pairs)
    table.add_row("median", "", "", f"{ratio:.2f}")
    return table


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    steps = measure_steps(args) if args.repeats else {}
    pairs = measure_demo(args) if args.pairs else []
    if args.json:
        out = {"model": args.model, "demo_model": args.demo_model, "busy": args.busy}
        print(json.dumps(out | {"steps": steps, "demo": pairs}))
        return 0
    console = Console()
    console.print(f"cores: {os.cpu_count()}; model {args.model}; 'x' = the time over auto's quiet")
    if steps:
        console.print(step_table(steps, args.busy))
    if pairs:
        console.print(demo_table(pairs, args.busy, args.demo_model))
    return 0
