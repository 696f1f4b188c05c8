"""The concurrent fault family's outcome, tally and table (bench/faults/concurrent.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from bench.faults.live import Answer
from engine.contract import greedy_matches_reference
from engine.model.loading import LoadedModel

MAX_TOKENS = 16  # generated per request (ignore_eos): a shorter answer is wrong
REFUSED = {429: "queue_full", 503: "draining", 400: "bad_request", 413: "too_large"}


@dataclass
class LoadOutcome:
    name: str
    injected: str
    sent: int
    succeeded: int
    refused: dict[str, int]  # documented refusals by reason
    cancelled: int  # clients that left on purpose
    failed: int  # neither: a broken stream, a 5xx, no answer
    wrong_outputs: int
    lost_entries: int | None  # None: the tier evicted or dropped (counted in the note)
    leaked_blocks: int | None  # held after the clients were done; None: not measurable
    integrity_ok: bool
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    base_p50_ms: float | None
    base_p99_ms: float | None
    recovery_s: float | None = None
    note: str = ""
    figures: dict[str, float] = field(default_factory=dict)


def percentile_ms(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q) * 1e3) if values else None


def refusal(answer: Answer) -> str | None:
    """The documented reason a request was refused; None if it was not refused."""
    if answer.status is None:
        return "closed unread" if answer.error == "closed" else None
    if answer.status == 200:  # an SSE error event after the headers
        return answer.error if answer.error in ("queue_full", "broken mid-stream") else None
    reason = REFUSED.get(answer.status)
    if answer.status in (429, 503) and answer.error != reason:
        return None  # a 429 or 503 that is not the documented refusal
    return reason


class Checks(NamedTuple):
    """What the run found after its clients were done."""

    leaked_blocks: int | None
    integrity_ok: bool
    lost_entries: int | None
    lost_note: str


def tally(
    model: LoadedModel,
    base: list[Answer],
    answers: list[Answer],
    checks: Checks,
    name: str,
    injected: str,
    recovery_s: float | None = None,
    note: str = "",
    figures: dict | None = None,
) -> LoadOutcome:
    """The outcome of `answers` (with the fault) against `base` (the same server without)."""
    ok = [a for a in answers if a.ok]
    refused = Counter(refusal(a) for a in answers if not a.ok)
    refused.pop(None, None)
    gone = sum(a.status is None and a.error != "closed" for a in answers)
    cancelled = sum(a.cancelled for a in answers)
    wrong = sum(not answer_is_right(model, a) for a in ok)
    ttfts = [a.ttft_s for a in ok if a.ttft_s is not None]
    base_ttfts = [a.ttft_s for a in base if a.ok and a.ttft_s is not None]
    notes = (note, checks.lost_note, f"{gone} without an answer" if gone else "")
    return LoadOutcome(
        name=name,
        injected=injected,
        sent=len(answers),
        succeeded=len(ok),
        refused=dict(refused),
        cancelled=cancelled,
        failed=len(answers) - len(ok) - sum(refused.values()) - cancelled,
        wrong_outputs=wrong,
        lost_entries=checks.lost_entries,
        leaked_blocks=checks.leaked_blocks,
        integrity_ok=checks.integrity_ok,
        ttft_p50_ms=percentile_ms(ttfts, 50),
        ttft_p99_ms=percentile_ms(ttfts, 99),
        base_p50_ms=percentile_ms(base_ttfts, 50),
        base_p99_ms=percentile_ms(base_ttfts, 99),
        recovery_s=recovery_s,
        note="; ".join(x for x in notes if x),
        figures=figures or {},
    )


def answer_is_right(model: LoadedModel, answer: Answer) -> bool:
    """A whole answer (MAX_TOKENS tokens) equal to the model's greedy reference."""
    return len(answer.token_ids) == MAX_TOKENS and greedy_matches_reference(
        model, answer.prompt, answer.token_ids
    )


def must_haves_hold(o: LoadOutcome) -> bool:
    """0 wrong, 0 lost, 0 leaked, integrity kept, and every request answered or refused
    with a documented status (or left by its client)."""
    return (
        o.wrong_outputs == 0
        and o.lost_entries in (0, None)
        and o.leaked_blocks in (0, None)
        and o.integrity_ok
        and o.failed == 0
    )


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def _ttft(o: LoadOutcome) -> str:
    """p50 / p99 (the baseline's p50 / p99)."""
    base = f"{_ms(o.base_p50_ms)} / {_ms(o.base_p99_ms)}"
    return f"{_ms(o.ttft_p50_ms)} / {_ms(o.ttft_p99_ms)} ({base})"


def markdown_table(outcomes: list[LoadOutcome]) -> list[str]:
    lines = [
        "| Fault | Injected | Sent / succeeded | Refused (reason) | Left by client | Failed "
        "| Wrong outputs | Lost entries | Leaked blocks | Integrity at close "
        "| TTFT p50 / p99 ms (baseline) | Recovery (s) | Notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        refused = ", ".join(f"{n} {why}" for why, n in sorted(o.refused.items())) or "0"
        lost = "n/a (LMDB evicted or dropped)" if o.lost_entries is None else str(o.lost_entries)
        leaked = "n/a (exited)" if o.leaked_blocks is None else str(o.leaked_blocks)
        ttft = _ttft(o)
        recovery = "n/a" if o.recovery_s is None else f"{o.recovery_s:.2f}"
        lines.append(
            f"| {o.name} | {o.injected} | {o.sent} / {o.succeeded} | {refused} | {o.cancelled} "
            f"| {o.failed} | {o.wrong_outputs} | {lost} | {leaked} "
            f"| {'ok' if o.integrity_ok else 'FAILED'} | {ttft} | {recovery} | {o.note} |"
        )
    return lines
