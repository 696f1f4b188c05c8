"""`python -m bench nsample` and `python -m bench contention`, at their smallest sizes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

import bench.contention as contention
from bench.contention import main as contention_main
from bench.nsample import main as nsample_main


def test_nsample_runs_pairs_whose_groups_prefill_the_prompt_once(capsys) -> None:
    argv = ["--n", "3", "--pairs", "2", "--prompt-tokens", "40", "--new-tokens", "4", "--json"]
    assert nsample_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["pairs"]) == 2
    for one, many in out["pairs"]:
        assert one["cached"] == [0]  # a fresh prompt each run
        assert many["cached"] == [0, 40, 40]  # the leader prefills; the others share it


def test_contention_measures_every_threading_choice_quiet_and_busy(capsys) -> None:
    argv = ["--repeats", "1", "--pairs", "0", "--busy", "1", "--prompt-tokens", "32",
            "--decode-batch", "2", "--decode-tokens", "3", "--json"]  # fmt: skip
    assert contention_main(argv) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    assert list(steps) == ["auto (default)", "2 threads", "2 threads, passive wait", "1 thread"]
    for runs in steps.values():
        assert [len(runs["quiet"]), len(runs["busy"])] == [1, 1]
        assert all(r["prefill_s"] > 0 and r["decode_step_s"] > 0 for r in runs["busy"])
    assert steps["1 thread"]["busy"][0]["threads_at_end"] == 1  # a fixed team stays as set


def test_a_contention_worker_that_dies_mid_run_is_reported_with_its_exit_status(
    monkeypatch,
) -> None:
    """The worker answers the quiet measurement, then exits 7 before the busy one: the run
    stops with that status, not with a broken pipe."""
    fake = "import json, sys\nprint('ready', flush=True)\nsys.stdin.readline()\n"
    fake += "print(json.dumps({'prefill_s': 1}), flush=True)\nsys.exit(7)"
    real = subprocess.Popen
    monkeypatch.setattr(contention.subprocess, "Popen", lambda cmd, **kw: real(
        [sys.executable, "-c", fake], **kw))  # fmt: skip
    monkeypatch.setattr(contention, "SETTLE_S", 0.2)
    args = argparse.Namespace(model="tiny", prompt_tokens=1, decode_batch=1, decode_tokens=2,
                              busy=0)  # fmt: skip
    with pytest.raises(RuntimeError, match="exited with 7"):
        contention.step_times(args, "1", {})
