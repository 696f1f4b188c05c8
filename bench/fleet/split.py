"""`bench fleet`'s prefill/decode scenarios: prefill and decode replicas (`kvstore serve
--role`) against as many `both` replicas, under one load (docs/BENCHMARKS.md "Prefill and
decode replicas").

The load: `--sessions` streaming chats of `--max-tokens` answers, and every
`--burst-every-s` seconds a burst of `--burst-size` prompts of `--burst-tokens` tokens (each
its own text, `--burst-max-tokens` answers) until the chats are done. Three layouts run the
kv router over one shared Redis, each replica pinned to a core of its own (taskset): `split`
(`--prefill-replicas` prefill replicas, the rest of `--replicas` decode), `colocated` (as many
`both` replicas as `split` has decode replicas: the baseline the prefill replicas are added
to) and `colocated-all` (as many `both` replicas as `split` has in all: the same hardware).

Per layout: the chats' inter-token latency p50/p90 (the time between consecutive streamed
chunks, at the client), TTFT p50/p90 of every request and of each kind, output tok/s, the
router's hand-over outcomes and the decode replicas' loads (`whole`: every block but at most
the last came from the tier). Answers are compared request by request across the layouts: a
`both` replica computes each request whole, so equal answers are a single replica's.

`split-kill-prefill` / `split-kill-decode`: the split layout with its first prefill (decode)
replica SIGKILLed once a third of the chats' turns finished: no request may be lost, and a
stream the killed replica was sending must end with an error event, never silently.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from bench.fleet.cluster import Fleet, FleetSpec, Killer, Tick
from bench.launch import by_label, metric_series
from bench.load.client import ChatOutcome, send_chat
from bench.load.report import percentile_ms, ratio
from bench.load.runner import Request, run_level, warm_up
from bench.load.workload import ChatSession, make_sessions, warmup_session, words

SPLIT_SCENARIOS = ("split", "split-kill-prefill", "split-kill-decode")
BURST_SEED = 17  # the bursts' word stream
KILL_DELAY_S = 2.0
HANDOVER_OUTCOMES = ("handed_over", "direct", "busy", "fallback")
# why a decode replica may load less than it was handed (its Redis failures read as misses)
REDIS_MISSES = ("store_errors_total", "tier_read_skipped_total", "verify_failures_total")


def layouts(scenario: str) -> tuple[str, ...]:
    return ("colocated", "colocated-all", "split") if scenario == "split" else ("split",)


def roles(args: argparse.Namespace, layout: str) -> tuple[str, ...]:
    """`split`: the prefill replicas, then the decode ones; `colocated`: as many `both`
    replicas as `split` has decode ones (the issue's baseline: what the prefill replicas are
    added to); `colocated-all`: as many `both` replicas as `split` has in all."""
    decode = args.replicas - args.prefill_replicas
    if layout == "colocated":
        return ("both",) * decode
    if layout == "colocated-all":
        return ("both",) * args.replicas
    return ("prefill",) * args.prefill_replicas + ("decode",) * decode


def burst_text(index: int, num_bytes: int, seed: int) -> str:
    rng = np.random.default_rng([seed, BURST_SEED, index])
    return f"Document {index}: {words(rng, num_bytes)}. Summarize it."


def burst_bytes(url: str, target_tokens: int, seed: int) -> int:
    """Text bytes that make a burst prompt of about `target_tokens` chat tokens (measured
    with the fleet's own tokenizer: Anthropic's count_tokens on the router)."""
    size, model = target_tokens, httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    for _ in range(3):
        messages = [{"role": "user", "content": burst_text(0, size, seed)}]
        body = {"model": model, "messages": messages}
        counted = httpx.post(f"{url}/v1/messages/count_tokens", json=body, timeout=30).json()
        size = max(64, int(size * target_tokens / max(1, counted["input_tokens"])))
    return size


class Bursts:
    """Bursts of long prompts every `every_s` until `stop`; each burst's requests at once."""

    def __init__(self, request: Request, args: argparse.Namespace, num_bytes: int):
        self.request, self.args, self.num_bytes = request, args, num_bytes
        self.outcomes: list[ChatOutcome] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Bursts:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join()

    def _run(self) -> None:
        index, threads = 0, []
        while not self.stop.wait(self.args.burst_every_s if index else 0.5):
            for _ in range(self.args.burst_size):
                threads.append(threading.Thread(target=self._send, args=(index,), daemon=True))
                threads[-1].start()
                index += 1
        for thread in threads:
            thread.join()

    def _send(self, index: int) -> None:
        text = burst_text(index, self.num_bytes, self.args.seed)
        body = self.request.body([{"role": "user", "content": text}])
        body["max_tokens"] = self.args.burst_max_tokens
        with httpx.Client(timeout=self.request.timeout_s) as client:
            out = send_chat(client, self.request.url, body, None)
        out.session, out.turn = -1, index
        with self._lock:
            self.outcomes.append(out)


def run_layout(
    args: argparse.Namespace, model_dir: Path, base: Path, scenario: str, layout: str
) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"{scenario}-{layout}-", dir=base))
    layout_roles = roles(args, layout)
    spec = FleetSpec(
        model_dir=model_dir, replicas=len(layout_roles), device_blocks=args.device_blocks,
        shared=True, route="kv", workdir=workdir, roles=layout_roles, pin_cores=True,
        handover_min_tokens=args.handover_min_tokens,
    )  # fmt: skip
    sessions = make_sessions(args.sessions, args.turns, args.system_prompt_bytes, args.seed)
    with Fleet(spec) as fleet:
        extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}
        request = Request(fleet.url, extra, args.max_tokens, args.timeout)
        for proc in fleet.replicas:  # each replica's first forward, on a prompt of its own
            warm_up(replace(request, url=proc.url), warmup_session(64, args.seed + proc.port))
        num_bytes = burst_bytes(fleet.url, args.burst_tokens, args.seed)
        chats, bursts, wall = _drive(args, fleet, request, sessions, scenario, num_bytes)
        result = summarize(chats, bursts, wall)
        result |= _handover_counts(fleet, spec)
    return result | {"scenario": scenario, "layout": layout, "roles": list(spec.roles),
                     "killed": list(fleet.killed), "burst_bytes": num_bytes}  # fmt: skip


def _drive(
    args: argparse.Namespace, fleet: Fleet, request: Request, sessions: list[ChatSession],
    scenario: str, num_bytes: int,
) -> tuple[list[ChatOutcome], list[ChatOutcome], float]:  # fmt: skip
    total = len(sessions) * args.turns
    victim = None
    if scenario == "split-kill-prefill":
        victim = 0
    elif scenario == "split-kill-decode":
        victim = args.prefill_replicas
    killer = Killer(fleet, victim, total, KILL_DELAY_S)  # the chats run in step: by
    # KILL_DELAY_S after a third of their turns, their next turns are streaming
    bar = tqdm(total=total, desc=scenario, unit="turn", leave=False, disable=args.json)
    with bar, Bursts(request, args, num_bytes) as bursts:
        chats, wall = run_level(request, sessions, len(sessions), Tick(bar, killer))
    return chats, bursts.outcomes, wall


def _handover_counts(fleet: Fleet, spec: FleetSpec) -> dict:
    """The router's hand-over outcomes, and the live decode replicas' loads and the reasons
    a load may come up short (their Redis errors, reads the gate skipped, verify failures)."""
    router = by_label(metric_series(fleet.metrics()), "kvstore_router_handovers_total")
    loads: dict[str, float] = {}
    misses: dict[str, float] = {}
    for i in range(spec.replicas):
        if i in fleet.killed or spec.role(i) == "prefill":
            continue
        page = metric_series(fleet.metrics(i))
        for key, value in by_label(page, "kvstore_handovers_received_total").items():
            loads[key] = loads.get(key, 0.0) + value
        for name in REDIS_MISSES:
            redis = [v for k, v in page.items() if k.startswith(f"kvstore_{name}{{")
                     and 'tier="redis"' in k]  # fmt: skip
            misses[name] = misses.get(name, 0.0) + sum(redis)
    return {"handovers": router, "decode_loads": loads, "decode_redis_misses": misses}


def summarize(chats: Sequence[ChatOutcome], bursts: Sequence[ChatOutcome], wall_s: float) -> dict:
    """One layout's figures. A failed request is `partial` when its stream ended with an
    error event (the documented end of a broken stream, text before it or not), `cut` when
    it streamed text and then ended with neither an error event nor a usage (silently), and
    `lost` when it got neither text nor an error event."""
    every = [*chats, *bursts]
    ok = [o for o in every if o.ok]
    failed = [o for o in every if not o.ok]
    gaps = [g for o in chats if o.ok for g in o.gaps_s()]

    def ttft(outs: Sequence[ChatOutcome], q: float) -> float | None:
        return percentile_ms([o.ttft_s for o in outs if o.ok and o.ttft_s is not None], q)

    long = [o for o in ok if o.session == -1]
    return {
        "requests": len(every), "ok": len(ok), "chats": len(chats), "bursts": len(bursts),
        "partial": sum(1 for o in failed if o.error_event),
        "cut": sum(1 for o in failed if o.text and not o.error_event),
        "lost": sum(1 for o in failed if not o.text and not o.error_event),
        "errors": sorted({o.error for o in failed if o.error})[:5],
        "wall_s": wall_s,
        "itl_p50_ms": percentile_ms(gaps, 50), "itl_p90_ms": percentile_ms(gaps, 90),
        "ttft_p50_ms": ttft(every, 50), "ttft_p90_ms": ttft(every, 90),
        "chat_ttft_p50_ms": ttft(chats, 50), "burst_ttft_p50_ms": ttft(bursts, 50),
        "output_tok_per_s": sum(o.completion_tokens for o in ok) / wall_s if wall_s else None,
        "burst_prompt_tokens": int(np.mean([o.prompt_tokens for o in long])) if long else 0,
        "answers": {f"{o.session}:{o.turn}": o.text for o in ok},
    }  # fmt: skip


def compare(colocated: dict, split: dict) -> dict:
    """Split ÷ colocated, and the answers both layouts gave to the same request."""
    common = sorted(set(colocated["answers"]) & set(split["answers"]))
    same = sum(colocated["answers"][k] == split["answers"][k] for k in common)
    return {
        "itl_p90": ratio(split["itl_p90_ms"], colocated["itl_p90_ms"]),
        "itl_p50": ratio(split["itl_p50_ms"], colocated["itl_p50_ms"]),
        "ttft_p50": ratio(split["ttft_p50_ms"], colocated["ttft_p50_ms"]),
        "tok_per_s": ratio(split["output_tok_per_s"], colocated["output_tok_per_s"]),
        "identical_answers": [same, len(common)],
    }


def run_scenario(args: argparse.Namespace, model_dir: Path, base: Path, scenario: str) -> list:
    runs = [run_layout(args, model_dir, base, scenario, layout) for layout in layouts(scenario)]
    if scenario == "split":
        colocated, colocated_all, split = runs
        split["versus_colocated"] = compare(colocated, split)
        split["versus_colocated_all"] = compare(colocated_all, split)
    return runs


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_split(runs: list[dict]) -> str:
    """The prefill/decode runs as a table (empty: none ran)."""
    if not runs:
        return ""
    lines = ["| scenario | layout | roles | answered | partial | cut | lost | ITL p50 ms | "
             "ITL p90 ms | TTFT p50 ms | chat TTFT p50 | burst TTFT p50 | tok/s | "
             "hand-overs | decode loads whole/partial |",
             "|" + "---|" * 15]  # fmt: skip
    for run in runs:
        roles_text = ",".join(r[0] for r in run["roles"])
        h, d = run["handovers"], run["decode_loads"]
        handed = "-" if not h else "/".join(f"{h.get(k, 0):.0f}" for k in HANDOVER_OUTCOMES)
        loads = "-" if not d else f"{d.get('whole', 0):.0f}/{d.get('partial', 0):.0f}"
        lines.append(
            f"| {run['scenario']} | {run['layout']} | {roles_text} | {run['ok']}/"
            f"{run['requests']} | {run['partial']} | {run['cut']} | {run['lost']} | "
            f"{_fmt(run['itl_p50_ms'], '.1f')} | {_fmt(run['itl_p90_ms'], '.1f')} | "
            f"{_fmt(run['ttft_p50_ms'], '.0f')} | {_fmt(run['chat_ttft_p50_ms'], '.0f')} | "
            f"{_fmt(run['burst_ttft_p50_ms'], '.0f')} | {_fmt(run['output_tok_per_s'], '.1f')}"
            f" | {handed} | {loads} |"
        )
    for run in runs:
        misses = run.get("decode_redis_misses") or {}
        if any(misses.values()):
            lines.append(
                f"\n{run['scenario']} {run['layout']}: the decode replicas' Redis errors "
                f"{misses.get('store_errors_total', 0):.0f}, reads skipped by the gate "
                f"{misses.get('tier_read_skipped_total', 0):.0f}, verify failures "
                f"{misses.get('verify_failures_total', 0):.0f}"
            )
    for run in runs:
        for key, name in (("versus_colocated", "colocated"), ("versus_colocated_all",
                                                                "colocated-all")):  # fmt: skip
            if key in run:
                lines.append(_versus(run[key], name))
    if any("versus_colocated" in run for run in runs):
        lines.append("(hand-overs: handed over/direct/busy/fallback)")
    return "\n".join(lines)


def _versus(v: dict, name: str) -> str:
    same, total = v["identical_answers"]
    return (
        f"\nsplit ÷ {name}: ITL p90 {_fmt(v['itl_p90'], '.2f')}, ITL p50 "
        f"{_fmt(v['itl_p50'], '.2f')}, TTFT p50 {_fmt(v['ttft_p50'], '.2f')}, tok/s "
        f"{_fmt(v['tok_per_s'], '.2f')}; identical answers {same}/{total}"
    )


def write_split_plot(runs: list[dict], path: Path) -> None:
    """Chats' inter-token latency and TTFT p50 per run, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['scenario']}\n{r['layout']}" for r in runs]
    x = np.arange(len(runs))
    fig, (itl, ttft) = plt.subplots(1, 2, figsize=(2.2 * len(runs) + 4, 4))
    itl.bar(x - 0.2, [r["itl_p50_ms"] or 0 for r in runs], 0.4, label="p50")
    itl.bar(x + 0.2, [r["itl_p90_ms"] or 0 for r in runs], 0.4, label="p90")
    itl.set_title("chats' inter-token latency (ms)")
    ttft.bar(x - 0.2, [r["chat_ttft_p50_ms"] or 0 for r in runs], 0.4, label="chats p50")
    ttft.bar(x + 0.2, [r["burst_ttft_p50_ms"] or 0 for r in runs], 0.4, label="bursts p50")
    ttft.set_title("TTFT (ms)")
    for ax in (itl, ttft):
        ax.set_xticks(list(x), labels)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_split_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill-replicas",
        type=int,
        default=1,
        help="split scenarios: replicas with --role prefill (the rest decode)",
    )
    parser.add_argument(
        "--burst-every-s",
        type=float,
        default=3.0,
        help="split scenarios: seconds between bursts of long prompts",
    )
    parser.add_argument("--burst-size", type=int, default=2, help="prompts in each burst")
    parser.add_argument(
        "--burst-tokens",
        type=int,
        default=2048,
        help="tokens of each burst prompt (about: measured by count_tokens)",
    )
    parser.add_argument(
        "--burst-max-tokens", type=int, default=16, help="the answer of each burst prompt"
    )
    parser.add_argument("--handover-min-tokens", type=int, default=None,
                        help="the router's --handover-min-tokens (default: its own)")  # fmt: skip
