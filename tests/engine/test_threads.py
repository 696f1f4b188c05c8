"""The loop thread's torch team is sized to the cores other processes leave free."""

from __future__ import annotations

import subprocess
import time

import pytest
import torch

from engine.cli import build_parser
from engine.commands import thread_config
from engine.loop.threads import ThreadConfig, ThreadGovernor, busy_cpu_s


@pytest.mark.parametrize(
    ("others", "threads"),
    [(0.0, 2), (0.4, 2), (0.6, 1), (1.0, 1), (1.4, 1), (2.0, 1), (3.5, 1)],
)
def test_team_is_the_free_cores_rounded_and_never_empty(others: float, threads: int) -> None:
    governor = ThreadGovernor(ThreadConfig(), max_threads=2, num_cpus=2)
    assert governor.fit(others) == threads


def test_team_never_exceeds_its_configured_threads() -> None:
    governor = ThreadGovernor(ThreadConfig(), max_threads=4, num_cpus=16)
    assert [governor.fit(o) for o in (0.0, 11.0, 12.6, 13.4, 20.0)] == [4, 4, 3, 3, 1]


def test_busy_processes_beside_it_shrink_the_team_to_one() -> None:
    if busy_cpu_s() is None:
        pytest.skip("no /proc/stat: the team is not adapted here")
    before = torch.get_num_threads()
    busy = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(2)]
    try:
        torch.set_num_threads(2)
        governor = ThreadGovernor(ThreadConfig(interval_s=0.3), max_threads=2, num_cpus=2)
        end, x = time.monotonic() + 1.0, torch.randn(256, 256)
        while time.monotonic() < end:
            x = torch.tanh(x @ x)  # the engine's steps, between which it ticks
            governor.tick()
        assert (governor.threads, torch.get_num_threads()) == (1, 1)
    finally:
        for p in busy:
            p.kill()
        torch.set_num_threads(before)


def test_a_fixed_team_or_a_single_thread_is_never_resized() -> None:
    assert not ThreadGovernor(ThreadConfig(adapt=False), max_threads=2).on
    assert not ThreadGovernor(ThreadConfig(), max_threads=1).on


@pytest.mark.parametrize(
    ("bad", "message"),
    [({"threads": 0}, "threads must be an int >= 1"), ({"interval_s": 0}, "interval_s must be")],
)
def test_bad_thread_config_says_what_to_fix(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ThreadConfig(**bad)


def test_threads_flag_is_auto_by_default_or_a_fixed_count() -> None:
    parser = build_parser()
    auto = parser.parse_args(["serve"])
    fixed = parser.parse_args(["demo", "--threads", "3"])
    assert thread_config(auto) == ThreadConfig(threads=None, adapt=True)
    assert thread_config(fixed) == ThreadConfig(threads=3, adapt=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--threads", "none"])
