"""`python -m bench gpu` (the prepared GPU run) and `python -m bench step`, on the CPU: the
run's steps at toy sizes (--smoke), its JSON and table, a budget that runs out, and the
figures it holds to their targets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu.figures import markdown

ROOT = Path(__file__).resolve().parents[2]
STEP_KEYS = {"batch", "kvstore_host_us", "peer_host_us", "kvstore_ops", "peer_ops"}


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bench", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_the_smoke_run_writes_each_steps_result_and_the_table(tmp_path):
    done = bench("gpu", "--smoke", "--only", "tests,ttft,step", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert list(report["steps"]) == ["tests", "ttft", "step"]
    assert all(step["rc"] == 0 for step in report["steps"].values())
    assert report["steps"]["tests"]["result"]["passed"] >= 5
    tiers = {p["tier"] for p in report["steps"]["ttft"]["result"]["points"]}
    assert tiers == {"device", "memory", "lmdb", "redis"}
    rows = report["steps"]["step"]["result"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(set(r) >= STEP_KEYS for r in rows)
    table = (tmp_path / "gpu.md").read_text()
    assert "| ttft device, 96 of 128 cached: ÷ ideal |" in table
    assert "| step batch 2: host µs ÷ peer |" in table
    assert done.stdout == table + "\n"


def test_a_spent_budget_starts_no_step_and_fails_the_run(tmp_path):
    done = bench("gpu", "--smoke", "--budget-s", "0", "--out", str(tmp_path), timeout=120)
    assert done.returncode == 1
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert {s.get("skipped") for s in report["steps"].values()} == {"the budget was spent"}
    assert len(report["steps"]) == 6


def test_the_table_holds_each_figure_to_its_target():
    report = {
        "machine": {"gpu": "H200"},
        "steps": {
            "load": {"rc": 0, "seconds": 100, "result": {"comparison": [
                {"concurrency": 1, "tok_s_ratio_kvstore_over_peer": 1.6,
                 "ttft_p50_ratio_kvstore_over_peer": 0.5, "same_text_kvstore_vs_peer": 1.0},
                {"concurrency": 8, "tok_s_ratio_kvstore_over_peer": 1.9,
                 "ttft_p50_ratio_kvstore_over_peer": 0.8, "same_text_kvstore_vs_peer": 0.5},
            ]}},
            "e2e": {"rc": 1, "seconds": 9, "tail": "boom\nRuntimeError: out of memory",
                    "result": {"workloads": [{"workload": "shared-prefix",
                                              "ratio_to_ideal": 0.95}]}},
            "step": {"rc": None, "skipped": "the budget was spent"},
            "codecs": {"rc": 0, "seconds": 50, "result": {"points": [
                {"tier": "device", "codec": "none", "cached_tokens": 2032,
                 "prompt_tokens": 2048, "ratio_to_device": 1.0},
                {"tier": "redis", "codec": "int8", "cached_tokens": 2032,
                 "prompt_tokens": 2048, "ratio_to_device": 1.2},
                {"tier": "memory", "codec": "int8", "cached_tokens": 2032,
                 "prompt_tokens": 2048, "ratio_to_device": 1.3},
            ]}},
        },
    }  # fmt: skip
    table = markdown(report)
    assert "| ttft redis int8, 2032 of 2048 cached: ÷ device | 1.2 | ≤ 1.25 | yes |" in table
    assert "| ttft memory int8, 2032 of 2048 cached: ÷ device | 1.3 | - | - |" in table
    assert "ttft device none" not in table
    assert "| load c=1: tok/s ÷ peer | 1.6 | ≥ 1.5 | yes |" in table
    assert "| load c=8: tok/s ÷ peer | 1.9 | ≥ 2.0 | no |" in table
    assert "| load c=8: TTFT p50 ÷ peer | 0.8 | ≤ 0.7 | no |" in table
    assert "| load c=8: texts as the peer's | 0.5 | 1 | no |" in table
    assert "| e2e shared-prefix: speed-up ÷ ideal speed-up | 0.95 | ≥ 0.9 | yes |" in table
    assert "| e2e | 1 | 9 | RuntimeError: out of memory |" in table
    assert "| step | None | - | the budget was spent |" in table


def test_what_is_carried_runs_where_nothing_is_installed(tmp_path):
    """The packages carried are each root's whole closure; the carried redis-server runs
    through its wrapper on the libraries beside it; activating an empty folder says what to
    do."""
    from bench.gpu.carry import _redis_server, activate, closure

    packages = closure(("fastapi", "openai"))
    assert {"fastapi", "starlette", "pydantic", "pydantic-core", "openai"} <= set(packages)
    assert "torch" not in packages
    _redis_server(tmp_path)
    done = subprocess.run([str(tmp_path / "bin" / "redis-server"), "--version"],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("Redis server v=")
    assert sorted(p.name for p in (tmp_path / "lib").iterdir())  # its libraries, carried
    with pytest.raises(SystemExit, match="holds no wheels"):
        activate(tmp_path)
