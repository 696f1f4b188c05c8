"""The server's heap policy: one trim per quiet spell after requests, none while busy."""

from __future__ import annotations

import asyncio

from engine.server.heap import QuietTrimmer


def test_the_heap_is_trimmed_once_per_quiet_spell_and_never_while_requests_run() -> None:
    state = {"seen": 0, "in_flight": 0}
    trimmer = QuietTrimmer(lambda: state["seen"], lambda: state["in_flight"], 0.05, 0.01)

    async def scenario() -> list[int]:
        task = asyncio.create_task(trimmer.run())
        trims = []
        for seen, in_flight in [(0, 0), (3, 0), (3, 0), (5, 2), (5, 2), (5, 0)]:
            state.update(seen=seen, in_flight=in_flight)
            await asyncio.sleep(0.2)
            trims.append(trimmer.trims)
        task.cancel()
        return trims

    # nothing served yet: no trim; 3 served then quiet: one; still quiet: no more; busy:
    # none; quiet again after 2 more: the second
    assert asyncio.run(scenario()) == [0, 1, 1, 1, 1, 2]
