"""The server's heap policy: one trim per quiet spell after requests, none while busy (ticks
driven on an explicit clock: no timing in the test)."""

from __future__ import annotations

import asyncio

from engine.server.heap import QuietTrimmer


def test_the_heap_is_trimmed_once_per_quiet_spell_and_never_while_requests_run() -> None:
    state = {"seen": 0, "in_flight": 0}
    trimmer = QuietTrimmer(lambda: state["seen"], lambda: state["in_flight"], quiet_s=2.0)
    ticks = [  # (requests seen, in flight, now)
        (0, 0, 0.0), (0, 0, 5.0),  # nothing served yet: no trim
        (3, 1, 6.0), (3, 0, 7.0), (3, 0, 8.9),  # 3 served, quiet for 1.9 s: not yet
        (3, 0, 9.0),  # quiet for 2 s: the trim
        (3, 0, 20.0),  # still quiet: no more
        (5, 2, 21.0), (5, 2, 30.0),  # busy: none
        (5, 0, 31.0), (5, 0, 33.0),  # quiet again after 2 more: the second
    ]  # fmt: skip
    due = []
    for seen, in_flight, now in ticks:
        state.update(seen=seen, in_flight=in_flight)
        due.append(trimmer.due(now))
    assert due == [False, False, False, False, False, True, False, False, False, False, True]


def test_the_running_trimmer_trims_after_a_quiet_spell() -> None:
    state = {"seen": 1, "in_flight": 0}
    trimmer = QuietTrimmer(lambda: state["seen"], lambda: 0, quiet_s=0.0, tick_s=0.001)
    state["seen"] = 2  # a request came after the trimmer started

    async def until_trimmed() -> int:
        task = asyncio.create_task(trimmer.run())
        while trimmer.trims == 0:
            await asyncio.sleep(0.001)
        task.cancel()
        return trimmer.trims

    assert asyncio.run(asyncio.wait_for(until_trimmed(), timeout=30.0)) == 1
