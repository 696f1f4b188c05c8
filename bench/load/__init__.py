"""Serving under concurrent load: `kvstore serve` and `transformers serve --continuous-batching`.

    python -m bench load [--levels 1,2,4,8,16] [--sessions 8] [--turns 3] [--max-tokens 32]
        [--system-prompt-bytes 1024] [--seed 0] [--model tiny|smollm2|DIR] [--device cpu|cuda]
        [--kvstore-arg ARG ...] [--no-peer] [--url URL]
        [--pool-blocks N] [--keep-servers] [--timeout S] [--json] [--out DIR]

Both servers serve one saved model directory (`tiny` is saved, model and tokenizer, to a
temporary directory), so their weights are identical; each runs on 127.0.0.1 in its own
process group, in float32 on the CPU (--device cuda: the GPU), with 16-token blocks (pages)
and the same KV pool in blocks, sized to hold the largest level's sessions whole
(--pool-blocks), and is stopped at the end whatever happens (SIGTERM included). With `--url`
the kvstore server is an existing one (then it is neither started, restarted nor stopped; the
peer still serves `--model`).
With --out, the servers' logs are kept there too.

Workload: closed-loop multi-turn chat. At concurrency level c, c workers each take whole
sessions from max(--sessions, c) of them; a session sends --turns user turns in order, turn
k+1 carrying every earlier turn with the assistant's actual answer (a real chat client). All
sessions share one --system-prompt-bytes ASCII system prompt; user texts are distinct per
session and turn and deterministic from --seed, so session s is the same at every level.
Greedy (temperature 0), --max-tokens tokens a turn with EOS ignored (kvstore: ignore_eos;
the peer: a generation_config whose eos_token_id is -1); completion_tokens is what the
servers' usage reports.

Each server is restarted before every level (--keep-servers: once for all levels), so every
level starts from an empty cache, equal for both; one warm-up request on another system prompt
(sharing no block with the workload) is sent to each new server and not counted. One server
is up at a time: kvstore's levels, then the peer's.

Per level and server: output tok/s (completion tokens / the level's wall time), req/s, TTFT
p50/p90/p99 (client side: send to the first SSE chunk with non-empty text), the cached share
(sum cached_tokens / sum prompt_tokens of the usage; None for a server that does not report
cached tokens, as the peer), requests ok and failed; per server, tok/s and TTFT p50 as ratios
to level 1 and the share of (session, turn) answers identical to level 1's
(`same_text_c1_vs_c8`: kvstore, level 8); per level, kvstore over the peer (tok/s and TTFT p50
ratios, identical answers). Exit status 1 if a kvstore request failed or kvstore could not
run; a peer that cannot start is reported (why) and the run goes on with kvstore only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from bench.load.driver import run_all, sigterm_as_exit
from bench.load.output import print_tables, write_outputs
from bench.load.report import failures, finish
from bench.load.servers import BLOCK_TOKENS, pool_blocks, prepare_model
from engine.extras import require


def parse_levels(text: str) -> list[int]:
    try:
        levels = sorted({int(item) for item in text.split(",") if item.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--levels takes ints like 1,2,4, not {text!r}") from None
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError("--levels must be ints >= 1")
    return levels


def build_parser() -> argparse.ArgumentParser:
    summary = __doc__.split("\n")[0]
    parser = argparse.ArgumentParser(
        prog="python -m bench load",
        description=summary,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--levels", type=parse_levels, default=[1, 2, 4, 8, 16], help="concurrency levels")
    add("--sessions", type=int, default=8, help="sessions per level: max(this, level)")
    add("--turns", type=int, default=3, help="user turns per session")
    add("--max-tokens", type=int, default=32, help="generated tokens per turn")
    add("--system-prompt-bytes", type=int, default=1024, help="shared system prompt length")
    add("--seed", type=int, default=0, help="seed of the prompt texts")
    add(
        "--model",
        default="tiny",
        help="tiny, smollm2, dummy:NAME (saved once, bfloat16 on a GPU), a .gguf file or a "
        "local model directory (both servers)",
    )
    add("--device", choices=("cpu", "cuda"), default="cpu", help="both servers' device")
    add(
        "--kvstore-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for `kvstore serve` (repeat it; e.g. --kvstore-arg=--tail-blocks "
        "--kvstore-arg=0): A/B pairs of engine settings",
    )
    add("--no-peer", action="store_true", help="kvstore only")
    add("--url", default=None, help="an existing kvstore server (not started nor restarted)")
    add("--api-key", default=None, help="Bearer key for --url")
    add(
        "--pool-blocks",
        type=int,
        default=None,
        help="KV pool of both servers, blocks of 16 tokens (default: the largest level's sessions)",
    )
    add("--keep-servers", action="store_true", help="one server for all levels (no restarts)")
    add("--timeout", type=float, default=300.0, help="per request, seconds")
    add("--json", action="store_true", help="print the report as JSON")
    add("--out", type=Path, default=None, help="write load.json, load.md and load.png here")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("sessions", "turns", "max_tokens", "system_prompt_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.url is not None:
        args.url = args.url.rstrip("/")
    if args.pool_blocks is None:
        most = max(args.sessions, *args.levels)
        args.pool_blocks = pool_blocks(most, args.turns, args.max_tokens, args.system_prompt_bytes)
    elif args.pool_blocks < 1:
        parser.error("--pool-blocks must be >= 1")
    return args


def config(args: argparse.Namespace, model_dir: Path | None) -> dict:
    return {"levels": args.levels, "sessions": args.sessions, "turns": args.turns,
            "max_tokens": args.max_tokens, "system_prompt_bytes": args.system_prompt_bytes,
            "seed": args.seed, "model": args.model, "device": args.device,
            "kvstore_args": args.kvstore_arg,
            "model_dir": None if model_dir is None else str(model_dir),
            "block_tokens": BLOCK_TOKENS, "pool_blocks": args.pool_blocks, "url": args.url,
            "keep_servers": args.keep_servers, "timeout_s": args.timeout}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    with sigterm_as_exit(), tempfile.TemporaryDirectory(prefix="bench-load-") as work:
        needs_model = args.url is None or not args.no_peer
        try:
            model_dir = prepare_model(args.model, Path(work), args.device) if needs_model else None
        except ValueError as e:  # engine.model.files.ModelLoadError: neither tiny nor a directory
            raise SystemExit(f"bench load: --model: {e}") from None
        report = {"benchmark": "load", "config": config(args, model_dir)}
        report |= run_all(args, model_dir, Path(work))
        if args.out is not None:
            keep_logs(Path(work), args.out)
    return finish(report)


def keep_logs(work: Path, out: Path) -> None:
    """The servers' logs (kvstore.log, peer.log: every start appended) into --out."""
    out.mkdir(parents=True, exist_ok=True)
    for log in work.glob("*.log"):
        shutil.copyfile(log, out / log.name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out is not None:  # before the run: no partial --out
        require("matplotlib", needed_by="--out")
    report = run(args)
    if args.json:
        print(json.dumps(report))
    else:
        print_tables(report)
    if args.out is not None:
        write_outputs(report, args.out)
    kvstore = report["servers"]["kvstore"]
    return 1 if kvstore["error"] or failures(report) else 0
