"""A fleet live on loopback: `kvstore router` against round-robin in front of the same
replicas, on a multi-session chat workload.

    python -m bench fleet [--model tiny] [--replicas 3] [--sessions 12] [--turns 4]
        [--think-s 1.0] [--scenarios private,shared,kill,host-tiers,host-kill]
        [--out DIR] [--json]
    python -m bench fleet --scenarios split,split-kill-prefill,split-kill-decode
        --replicas 2 --sessions 8 --max-tokens 128 [--burst-every-s 3] [--burst-tokens 2048]

Scenarios (each route gets fresh replicas, caches and Redis; routes run one after another):
- `private`: each replica has its own device pool and LMDB, no shared tier;
- `shared`: the replicas share one Redis under their device pools;
- `kill`: `shared` with the kv router, and replica 0 SIGKILLed once a third of the
  requests finished: every request must be answered, or failed with an error only if it had
  already streamed part of its answer;
- `host-tiers`: small device pools (`--small-device-blocks`) over a private host-memory
  tier each (`--memory-cache-gb`); the kv router fed by every tier's events against the kv
  router fed by device events alone (route `kv-device`, `kvstore router
  --device-events-only`): a chat whose blocks left the device for the host tier of its
  replica is a hit there, and a cold miss anywhere else;
- `host-kill`: `host-tiers` with the kv router, and replica 0 SIGKILLed as in `kill`;
- `split`, `split-kill-prefill`, `split-kill-decode`: prefill and decode replicas against as
  many `both` replicas, under streaming chats and bursts of long prompts (bench/fleet/split.py);
- `handover-sweep`: what a hand-over costs and saves per prompt length
  (bench/fleet/handover_sweep.py).

Each session is a chat: a shared system prompt, a long first message of its own (a document
the session is about), then short follow-ups; every turn resends the whole history with the
model's real answers, after a user's pause (`--think-s`, exponential, seeded: the same
pauses on every route). All sessions run at once (one client each). Per route:
TTFT p50/p90, output tok/s, the share of prompt tokens served from cache and by which tier
(from the replicas' /metrics), and requests per replica (from the router's /health).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from bench.fleet.cluster import Fleet, FleetSpec, Killer, Tick
from bench.fleet.handover_sweep import add_sweep_arguments, print_sweep, run_sweep
from bench.fleet.report import print_report, summarize, write_plot
from bench.fleet.split import (
    SPLIT_SCENARIOS,
    add_split_arguments,
    print_split,
    run_scenario,
    write_split_plot,
)
from bench.load.runner import Request, run_level, warm_up
from bench.load.servers import prepare_model
from bench.load.workload import ChatSession, make_sessions, warmup_session, words

SCENARIOS = ("private", "shared", "kill", "host-tiers", "host-kill", *SPLIT_SCENARIOS,
             "handover-sweep")  # fmt: skip
ROUTES = {"host-tiers": ("kv", "kv-device"), "kill": ("kv",), "host-kill": ("kv",)}
DEFAULT_ROUTES = ("kv", "round-robin")


def fleet_sessions(args: argparse.Namespace) -> list[ChatSession]:
    """Chats whose first message carries a document of their own (`--document-bytes`)."""
    import numpy as np

    sessions = make_sessions(args.sessions, args.turns, args.system_prompt_bytes, args.seed)
    out = []
    for s in sessions:
        doc = words(np.random.default_rng([args.seed, 7, s.index]), args.document_bytes)
        first = f"Here is a document: {doc}. {s.questions[0]}"
        out.append(ChatSession(s.index, s.system, (first, *s.questions[1:])))
    return out


def run_route(
    args: argparse.Namespace, model_dir: Path, base: Path, scenario: str, route: str
) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"{scenario}-{route}-", dir=base))
    host = scenario.startswith("host")
    spec = FleetSpec(
        model_dir=model_dir,
        replicas=args.replicas,
        device_blocks=args.small_device_blocks if host else args.device_blocks,
        shared=scenario in ("shared", "kill"),
        route=route,
        workdir=workdir,
        prefill_weight=args.prefill_weight,
        decode_weight=args.decode_weight,
        memory_cache_gb=args.memory_cache_gb if host else None,
    )
    sessions = fleet_sessions(args)
    with Fleet(spec) as fleet:
        extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}
        request = Request(fleet.url, extra, args.max_tokens, args.timeout)
        for proc in fleet.replicas:  # each replica's first forward, on a prompt of its own
            warm_up(replace(request, url=proc.url), warmup_session(64, args.seed + proc.port))
        total = len(sessions) * args.turns
        killer = Killer(fleet, 0 if scenario.endswith("kill") else None, total)
        desc = f"{scenario} {route}"
        with tqdm(total=total, desc=desc, unit="req", leave=False, disable=args.json) as bar:
            tick, think = Tick(bar, killer), _thinker(args.think_s, args.seed)
            outcomes, wall = run_level(request, sessions, len(sessions), tick, think)
        result = summarize(outcomes, wall, fleet.tier_hits(), fleet.routed())
    result |= {"scenario": scenario, "route": route, "killed": list(fleet.killed)}
    return result


def _thinker(mean_s: float, seed: int):
    """A user's pause before each next turn: exponential, seeded by (session, turn). Without
    it the chats run in lock step, and round-robin over 12 chats and 3 replicas would send
    each chat's turns to one replica by accident (12 is a multiple of 3)."""
    import numpy as np

    def think(session: ChatSession, turn: int) -> None:
        if mean_s > 0:
            time.sleep(np.random.default_rng([seed, 13, session.index, turn]).exponential(mean_s))

    return think


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        "python -m bench fleet", description=__doc__, formatter_class=raw
    )
    parser.add_argument("--model", default="tiny", help="tiny, smollm2 or a model directory")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=12, help="chats, all at once")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompt-bytes", type=int, default=256)
    parser.add_argument(
        "--document-bytes",
        type=int,
        default=1536,
        help="each session's own document, in its first message",
    )
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument(
        "--think-s",
        type=float,
        default=1.0,
        help="mean pause before a chat's next turn (exponential)",
    )
    parser.add_argument("--device-blocks", type=int, default=1024, help="per replica")
    parser.add_argument(
        "--small-device-blocks",
        type=int,
        default=160,
        help="per replica in the host-tier scenarios: a little over one chat's prompt",
    )
    parser.add_argument(
        "--memory-cache-gb",
        type=float,
        default=1.0,
        help="each replica's host-memory tier in the host-tier scenarios",
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS[:5]),
                        help=f"any of {', '.join(SCENARIOS)}")  # fmt: skip
    add_split_arguments(parser)
    add_sweep_arguments(parser)
    parser.add_argument("--prefill-weight", type=float, default=None)
    parser.add_argument("--decode-weight", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--workdir", default=None, help="replicas' logs and LMDBs (default tmp)")
    parser.add_argument("--out", default=None, help="write fleet.json and fleet.png here")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, or None."""
    for name in args.scenarios.split(","):
        if name.strip() not in SCENARIOS:
            return f"unknown scenario {name.strip()!r}; choose from {SCENARIOS}"
    if args.replicas < 2 or args.sessions < 1 or args.turns < 1:
        return "needs --replicas >= 2, --sessions >= 1 and --turns >= 1"
    if not 1 <= args.prefill_replicas < args.replicas:
        return "needs 1 <= --prefill-replicas < --replicas (the rest decode)"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = _check(args)
    if problem is not None:
        print(f"python -m bench fleet: error: {problem}", file=sys.stderr)
        return 2
    scenarios = [s.strip() for s in args.scenarios.split(",")]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        model_dir = prepare_model(args.model, Path(tmp))
        base = Path(args.workdir or tmp)
        base.mkdir(parents=True, exist_ok=True)
        runs, split, sweep = [], [], None
        for scenario in scenarios:
            if scenario == "handover-sweep":
                sweep = run_sweep(args, model_dir, base)
                continue
            if scenario in SPLIT_SCENARIOS:
                split += run_scenario(args, model_dir, base, scenario)
                continue
            for route in ROUTES.get(scenario, DEFAULT_ROUTES):
                runs.append(run_route(args, model_dir, base, scenario, route))
    report = {"config": vars(args), "runs": runs, "split_runs": split, "handover_sweep": sweep,
              "wall_s": time.perf_counter() - start}  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fleet.json").write_text(json.dumps(report, indent=2))
        if runs:
            write_plot(report, out / "fleet.png")
        if split:
            write_split_plot(split, out / "fleet-split.png")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        tables = (print_report(report) if runs else "", print_split(split), print_sweep(sweep))
        print("\n\n".join(t for t in tables if t))
    return 0
