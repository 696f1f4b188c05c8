"""Load generator for `kvstore serve` replicas: client-side TTFT and the servers' hit rate.

    python -m bench serve --url URL [--url URL2 ...] --workload multiturn --concurrency N
        [--requests N] [--api-key KEY] [--param KEY=VALUE ...] [--json]

The workload (bench.workloads) is cut into sessions: a request whose prompt extends an
earlier one is the next turn of that session and is sent only after it finished (a chat
client cannot send turn k+1 before it has the answer to turn k). `--concurrency` closed-loop
workers each take a whole session. Turn k of session s goes to URL (s + k) mod n with
`--route alternate` (consecutive turns land on different replicas: every hit past the first
turn comes through the shared tier), or URL s mod n with `--route session` (sticky).

Every request streams (`stream_options.include_usage`): TTFT is the time from sending it to
its first SSE chunk; the hit rate is sum(cached_tokens) / sum(prompt_tokens) of the usage the
servers report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from bench.traces import Request
from bench.workloads import WORKLOADS, WorkloadError, make_workload, parse_params

# Defaults sized for the pinned `tiny` model on a CPU (byte vocabulary, 4096 positions).
WORKLOAD_DEFAULTS = {
    "multiturn": {"num_turns": "4", "turn_tokens": "64", "answer_tokens": "32",
                  "system_prompt_len": "256", "vocab_size": "256"},
    "shared-prefix": {"num_groups": "4", "prompts_per_group": "8", "system_prompt_len": "512",
                      "question_len": "64", "vocab_size": "256"},
    "rag": {"num_requests": "32", "num_docs": "16", "doc_len": "128", "vocab_size": "256"},
    "conversation": {"num_sessions": "16", "first_turn_median": "256", "turn_median": "64",
                     "answer_median": "32", "max_prompt_tokens": "3000", "vocab_size": "256"},
}  # fmt: skip


class BenchError(RuntimeError):
    """A server refused the benchmark (unreachable, bad key, ...); the message says which."""


@dataclass
class Outcome:
    url: str
    ok: bool
    status: int
    ttft_s: float | None = None
    latency_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""


@dataclass
class Session:
    turns: list[Request] = field(default_factory=list)


def sessions_of(requests: Sequence[Request]) -> list[Session]:
    """Chain each request to the latest open session whose last prompt it extends."""
    sessions: list[Session] = []
    for request in requests:
        ids = request.token_ids
        for session in reversed(sessions):
            last = session.turns[-1].token_ids
            if len(last) < len(ids) and np.array_equal(ids[: len(last)], last):
                session.turns.append(request)
                break
        else:
            sessions.append(Session([request]))
    return sessions


def build_workload(name: str, params: Sequence[str], requests: int | None) -> list[Request]:
    """The workload's requests (bench defaults < --param), the first `requests` of them."""
    given = parse_params(params)
    pairs = {**WORKLOAD_DEFAULTS.get(name, {}), **given}
    if name == "multiturn" and requests and "num_clients" not in given:
        pairs["num_clients"] = str(math.ceil(requests / int(pairs["num_turns"])))
    out = make_workload(name, pairs).generate()
    return out[:requests] if requests else out


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def wait_ready(client, urls: Sequence[str], timeout_s: float) -> None:
    """Poll each URL's /health until it answers 200."""
    import httpx

    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                if client.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"{url}/health did not answer 200 within {timeout_s:.0f} s")
            time.sleep(0.2)


def served_model(client, url: str, api_key: str | None) -> str:
    response = client.get(f"{url}/v1/models", headers=_headers(api_key), timeout=10.0)
    if response.status_code != 200:
        raise BenchError(f"{url}/v1/models answered {response.status_code}: {response.text}")
    return response.json()["data"][0]["id"]


def send(client, url: str, body: dict, api_key: str | None) -> Outcome:
    """One streamed completion; TTFT is the arrival of the first SSE chunk."""
    start = time.perf_counter()
    out = Outcome(url, False, 0)
    with client.stream(
        "POST", f"{url}/v1/completions", json=body, headers=_headers(api_key)
    ) as response:
        out.status = response.status_code
        if response.status_code != 200:
            out.error = response.read().decode(errors="replace")[:200]
            out.latency_s = time.perf_counter() - start
            return out
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                out.ok = out.error == ""
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out.error = chunk["error"].get("message", "error")
            elif chunk.get("choices") and out.ttft_s is None:
                out.ttft_s = time.perf_counter() - start
            elif chunk.get("usage"):
                usage = chunk["usage"]
                out.prompt_tokens = usage["prompt_tokens"]
                out.completion_tokens = usage["completion_tokens"]
                out.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    out.latency_s = time.perf_counter() - start
    return out


class Runner:
    """Closed-loop workers over sessions; requests routed to the URLs."""

    def __init__(self, args: argparse.Namespace, model: str):
        self.args, self.model = args, model
        self._lock = threading.Lock()
        self.outcomes: list[Outcome] = []

    def url_for(self, session_index: int, turn_index: int) -> str:
        urls = self.args.url
        step = turn_index if self.args.route == "alternate" else 0
        return urls[(session_index + step) % len(urls)]

    def body(self, request: Request) -> dict:
        return {
            "model": self.model,
            "prompt": request.token_ids.tolist(),
            "max_tokens": self.args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def worker(self, sessions: queue.Queue, bar: tqdm) -> None:
        import httpx

        with httpx.Client(timeout=self.args.timeout_s) as client:
            while True:
                try:
                    index, session = sessions.get_nowait()
                except queue.Empty:
                    return
                for k, turn in enumerate(session.turns):
                    url = self.url_for(index, k)
                    try:
                        outcome = send(client, url, self.body(turn), self.args.api_key)
                    except httpx.HTTPError as e:
                        outcome = Outcome(url, False, 0, error=f"{type(e).__name__}: {e}")
                    with self._lock:
                        self.outcomes.append(outcome)
                    bar.update(1)

    def run(self, sessions: list[Session]) -> float:
        work: queue.Queue = queue.Queue()
        for item in enumerate(sessions):
            work.put(item)
        total = sum(len(s.turns) for s in sessions)
        bar = tqdm(total=total, desc="serve", unit="req", disable=self.args.json)
        threads = [
            threading.Thread(target=self.worker, args=(work, bar), daemon=True)
            for _ in range(self.args.concurrency)
        ]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        bar.close()
        return time.perf_counter() - start


def _ms(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q) * 1e3) if values else None


def _hit_rate(outcomes: Sequence[Outcome]) -> float:
    prompt = sum(o.prompt_tokens for o in outcomes)
    return sum(o.cached_tokens for o in outcomes) / prompt if prompt else 0.0


def summarize(outcomes: Sequence[Outcome], duration_s: float, args: argparse.Namespace) -> dict:
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    per_url = {}
    for url in args.url:
        mine = [o for o in ok if o.url == url]
        per_url[url] = {
            "requests": len(mine),
            "prompt_tokens": sum(o.prompt_tokens for o in mine),
            "cached_tokens": sum(o.cached_tokens for o in mine),
            "hit_rate": _hit_rate(mine),
        }
    errors = [o for o in outcomes if not o.ok]
    return {
        "workload": args.workload,
        "concurrency": args.concurrency,
        "urls": list(args.url),
        "requests": len(ok),
        "errors": len(errors),
        "error_statuses": sorted({o.status for o in errors}),
        "first_error": errors[0].error if errors else None,
        "duration_s": duration_s,
        "throughput_rps": len(ok) / duration_s if duration_s else 0.0,
        "output_tokens_per_s": sum(o.completion_tokens for o in ok) / duration_s
        if duration_s
        else 0.0,
        "ttft_p50_ms": _ms(ttfts, 50),
        "ttft_p99_ms": _ms(ttfts, 99),
        "latency_p50_ms": _ms([o.latency_s for o in ok], 50),
        "prompt_tokens": sum(o.prompt_tokens for o in ok),
        "cached_tokens": sum(o.cached_tokens for o in ok),
        "hit_rate": _hit_rate(ok),
        "per_url": per_url,
    }


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    table = Table(title=f"bench serve: {report['workload']}, concurrency {report['concurrency']}")
    for column in ("url", "requests", "prompt tokens", "cached tokens", "hit rate"):
        table.add_column(column, justify="left" if column == "url" else "right")
    for url, row in [*report["per_url"].items(), ("all", report)]:
        table.add_row(url, str(row["requests"]), str(row["prompt_tokens"]),
                      str(row["cached_tokens"]), f"{row['hit_rate']:.1%}")  # fmt: skip
    console = Console()
    console.print(table)
    console.print(
        f"TTFT p50 {fmt(report['ttft_p50_ms'], '.1f')} ms, p99 {fmt(report['ttft_p99_ms'], '.1f')}"
        f" ms; {report['throughput_rps']:.2f} req/s, {report['output_tokens_per_s']:.1f} tok/s;"
        f" {report['errors']} errors {report['error_statuses'] or ''}"
    )


def build_parser() -> argparse.ArgumentParser:
    summary = __doc__.split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m bench serve", description=summary)
    parser.add_argument("--url", action="append", required=True, help="server base URL (repeat)")
    parser.add_argument("--workload", default="multiturn", choices=sorted(WORKLOADS))
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="override a workload parameter (repeatable)")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop workers")
    parser.add_argument("--requests", type=int, default=None, help="first N requests only")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KVSTORE_API_KEY"),
        help="Bearer key (default: $KVSTORE_API_KEY, else none; the variable keeps it out of ps)",
    )
    parser.add_argument("--route", choices=("alternate", "session"), default="alternate")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    parser.add_argument("--wait-s", type=float, default=120.0, help="wait for /health first")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    import httpx

    parser = build_parser()
    args = parser.parse_args(argv)
    args.url = [u.rstrip("/") for u in args.url]
    if args.concurrency < 1 or (args.requests is not None and args.requests < 1):
        parser.error("--concurrency and --requests must be >= 1")
    try:
        sessions = sessions_of(build_workload(args.workload, args.param, args.requests))
        with httpx.Client() as client:
            wait_ready(client, args.url, args.wait_s)
            model = served_model(client, args.url[0], args.api_key)
    except (WorkloadError, BenchError) as e:
        parser.error(str(e))
    runner = Runner(args, model)
    duration = runner.run(sessions)
    report = summarize(runner.outcomes, duration, args)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if report["errors"] == 0 else 1
