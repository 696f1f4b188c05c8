"""Runs `bench load`: every level on each server, servers always stopped at the end. Servers
restarted per level run level by level (kvstore then the peer at each level), so the two
figures a ratio compares are measured minutes closer together on a machine whose speed
drifts."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
from tqdm import tqdm

from bench.load.report import summarize_level
from bench.load.runner import Request, run_level, warm_up
from bench.load.servers import KVSTORE, PEER, Running, Target, served_dtype
from bench.load.workload import make_sessions, warmup_session


def request_for(running: Running, target: Target, args: argparse.Namespace) -> Request:
    return Request(running.url, running.extra, args.max_tokens, args.timeout, target.api_key)


def start(target: Target, args: argparse.Namespace) -> Running:
    """A started (or reached) server that has answered one warm-up request."""
    running = target.start()
    session = warmup_session(args.system_prompt_bytes, args.seed)
    try:
        warm_up(request_for(running, target, args), session)
    except BaseException:
        running.stop()
        raise
    return running


def measure(running: Running, target: Target, args: argparse.Namespace, c: int) -> dict:
    sessions = make_sessions(max(args.sessions, c), args.turns, args.system_prompt_bytes, args.seed)
    total = len(sessions) * args.turns
    with tqdm(total=total, desc=f"{target.name} c={c}", unit="req", leave=False,
              disable=args.json) as bar:  # fmt: skip
        outcomes, wall = run_level(request_for(running, target, args), sessions, c, bar)
    return summarize_level(outcomes, wall, c, len(sessions), args.turns)


def new_entry(target: Target, args: argparse.Namespace) -> dict:
    restart = target.restartable and not args.keep_servers
    return {"label": target.label, "url": target.url, "restarted_per_level": restart,
            "command": [], "error": None, "levels": []}  # fmt: skip


def run_server(target: Target, args: argparse.Namespace, levels: list[int], entry: dict) -> None:
    """`levels` on one server into `entry`, started anew before each level unless
    --keep-servers (or --url, a server that is not ours). A server that cannot start or serve
    ends its run with `error` saying why; the levels measured so far stay."""
    restart = entry["restarted_per_level"]
    running: Running | None = None
    try:
        for c in levels:
            if running is None or restart:
                if running is not None:
                    running.stop()
                    running = None
                running = start(target, args)
            entry["levels"].append(measure(running, target, args, c))
    except (RuntimeError, httpx.HTTPError) as e:
        entry["error"] = f"{type(e).__name__}: {e}"
    finally:
        if running is not None:
            running.stop()
        entry["command"] = target.command or entry["command"]


def run_all(args: argparse.Namespace, model_dir: Path | None, log_dir: Path) -> dict:
    """Every level on kvstore and the peer, one server up at a time: level by level when
    servers restart per level, else kvstore's levels then the peer's."""
    blocks, dtype = args.pool_blocks, served_dtype(args.model, args.device)
    targets = [
        Target(
            KVSTORE,
            model_dir or Path(),
            log_dir,
            blocks,
            args.url,
            args.api_key,
            device=args.device,
            dtype=dtype,
            extra_args=args.kvstore_arg,
        )
    ]
    if not args.no_peer and model_dir is not None:
        peer = Target(PEER, model_dir, log_dir, blocks, device=args.device, dtype=dtype)
        targets.append(peer)
    servers = {target.name: new_entry(target, args) for target in targets}
    by_level = all(entry["restarted_per_level"] for entry in servers.values())
    rounds = [[c] for c in args.levels] if by_level else [args.levels]
    for levels in rounds:
        for target in targets:
            entry = servers[target.name]
            if entry["error"] is None:
                run_server(target, args, levels, entry)
                if entry["error"] is not None:
                    more = "; continuing with kvstore only" if target.name == PEER else ""
                    print(f"bench load: {target.name}: {entry['error']}{more}", file=sys.stderr)
    return {"servers": servers}


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit, so the servers' `finally` stops them (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
