"""`python -m bench load` at a tiny scale: real `kvstore serve` (and `transformers serve`)
subprocesses on a micro model, exact request and token counts, cache hits with a bound
derived from the chat template, servers stopped at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from transformers import LlamaConfig

from bench.launch import ServerProcess
from bench.load import main
from bench.load.servers import BLOCK_TOKENS
from bench.load.workload import make_sessions
from engine.model.loading import BYTE_VOCAB_SIZE, byte_tokenizer, random_model

pytestmark = pytest.mark.integration

SESSIONS, TURNS, TOKENS, SYSTEM_BYTES = 2, 2, 4, 100
TINY_ARGS = ["--sessions", str(SESSIONS), "--turns", str(TURNS), "--max-tokens", str(TOKENS),
             "--system-prompt-bytes", str(SYSTEM_BYTES)]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A micro Llama (2 layers, hidden 64) with the byte tokenizer and its chat template."""
    config = LlamaConfig(
        vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=256, eos_token_id=257,
        pad_token_id=258,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("load-model")
    random_model(config, seed=3).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def prompt_ids(messages: list[dict]) -> list[int]:
    """What `kvstore serve` prefills for a chat: the template's text, tokenized as is."""
    tokenizer = byte_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def whole_blocks(tokens: int) -> int:
    return tokens // BLOCK_TOKENS * BLOCK_TOKENS


def run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, dict]:
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


def assert_stopped(server: dict) -> None:
    port = int(server["command"][server["command"].index("--port") + 1])
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0)


def check_counts(level: dict, sessions: int) -> None:
    assert level["requests_expected"] == level["requests_ok"] == sessions * TURNS
    assert level["requests_failed"] == level["requests_not_sent"] == 0
    assert level["completion_tokens"] == sessions * TURNS * TOKENS  # EOS ignored
    assert [r["completion_tokens"] for r in level["requests"]] == [TOKENS] * sessions * TURNS
    assert level["ttft_p50_ms"] <= level["ttft_p90_ms"] <= level["ttft_p99_ms"]
    assert level["output_tok_per_s"] == pytest.approx(level["completion_tokens"] / level["wall_s"])


def test_kvstore_levels_count_every_request_and_hit_the_cache(model_dir, tmp_path, capsys):
    argv = ["--levels", "1,2", *TINY_ARGS, "--no-peer", "--model", str(model_dir), "--json"]
    code, report = run([*argv, "--out", str(tmp_path)], capsys)
    assert code == 0
    assert set(report["servers"]) == {"kvstore"} and report["comparison"] == []
    kvstore = report["servers"]["kvstore"]
    assert kvstore["error"] is None and kvstore["restarted_per_level"] is True
    assert [lv["concurrency"] for lv in kvstore["levels"]] == [1, 2]
    sessions = make_sessions(SESSIONS, TURNS, SYSTEM_BYTES, seed=0)
    firsts = [prompt_ids(s.messages([])) for s in sessions]
    shared = next(i for i, (a, b) in enumerate(zip(*firsts, strict=False)) if a != b)
    assert shared > SYSTEM_BYTES  # bos, "system: ", the system prompt, end of turn, "user: "
    bounds = []
    for level in kvstore["levels"]:
        check_counts(level, SESSIONS)
        rows = {(r["session"], r["turn"]): r for r in level["requests"]}
        assert [rows[s, 0]["prompt_tokens"] for s in range(SESSIONS)] == list(map(len, firsts))
        bound = 0
        for (s, t), row in rows.items():
            if t > 0:  # the previous turn's prompt is a prefix of this one: its whole blocks hit
                prev = rows[s, t - 1]["prompt_tokens"]
                assert whole_blocks(prev) <= row["cached_tokens"] < row["prompt_tokens"]
                bound += whole_blocks(prev)
        if level["concurrency"] == 1:  # session 1 starts after session 0 stored its prompts
            assert whole_blocks(shared) <= rows[1, 0]["cached_tokens"] <= shared
            bound += whole_blocks(shared)
        assert level["cached_tokens"] == sum(r["cached_tokens"] for r in rows.values())
        assert level["cached_share"] == level["cached_tokens"] / level["prompt_tokens"]
        assert level["cached_share"] >= bound / level["prompt_tokens"] > 0.3
        bounds.append(bound)
    assert kvstore["levels"][1]["same_text_vs_c1"] == 1.0  # greedy: the same answers
    assert kvstore["levels"][0]["tok_s_over_c1"] == 1.0
    assert report["same_text_c1_vs_c8"] is None  # level 8 did not run
    assert_stopped(kvstore)
    assert json.loads((tmp_path / "load.json").read_text()) == report
    assert "| kvstore | 2 | 2 | 4 | 0 |" in (tmp_path / "load.md").read_text()
    assert (tmp_path / "load.png").stat().st_size > 0


def test_kvstore_args_reach_the_server_it_starts(model_dir, capsys):
    argv = ["--levels", "1", *TINY_ARGS, "--no-peer", "--model", str(model_dir), "--json"]
    flag = ["--kvstore-arg=--tail-blocks", "--kvstore-arg=0"]
    code, report = run([*argv, *flag], capsys)
    assert code == 0 and report["config"]["kvstore_args"] == ["--tail-blocks", "0"]
    assert report["servers"]["kvstore"]["command"][-2:] == ["--tail-blocks", "0"]
    code, report = run([*argv, "--kvstore-arg=--no-such-flag"], capsys)
    assert code == 1  # the server refused it: the flag reached its command line
    assert "--no-such-flag" in report["servers"]["kvstore"]["error"]


def test_peer_serves_the_same_directory_and_is_compared_per_level(model_dir, capsys):
    argv = ["--levels", "1", "--sessions", "1", "--turns", "1", "--max-tokens", str(TOKENS),
            "--system-prompt-bytes", str(SYSTEM_BYTES), "--model", str(model_dir),
            "--json"]  # fmt: skip
    code, report = run(argv, capsys)
    assert code == 0
    kvstore, peer = report["servers"]["kvstore"], report["servers"]["peer"]
    assert peer["error"] is None, peer["error"]
    assert peer["command"][2:5] == ["transformers.cli.transformers", "serve", str(model_dir)]
    (mine,), (theirs,) = kvstore["levels"], peer["levels"]
    assert theirs["requests_ok"] == 1 and theirs["completion_tokens"] == TOKENS
    assert theirs["cached_tokens"] is None and theirs["cached_share"] is None  # not reported
    assert theirs["prompt_tokens"] == mine["prompt_tokens"]  # one template, one tokenizer
    (row,) = report["comparison"]
    assert row["concurrency"] == 1 and row["same_text_kvstore_vs_peer"] == 1.0
    assert row["tok_s_ratio_kvstore_over_peer"] == pytest.approx(
        mine["output_tok_per_s"] / theirs["output_tok_per_s"]
    )
    assert_stopped(kvstore)
    assert_stopped(peer)


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path) -> None:
    args = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    server = ServerProcess(args, 1, tmp_path / "x.log", {}, name="broken", ready_timeout_s=10)
    with pytest.raises(RuntimeError, match=r"broken on port 1 did not start \(exited\)"):
        server.start().wait_ready()
    assert "no model here" in server.log_tail()


@pytest.mark.skipif(not Path("/proc").exists(), reason="tells an exited process by /proc")
def test_a_server_nobody_stopped_goes_when_the_process_that_started_it_exits(tmp_path) -> None:
    # a server runs in a session of its own: without this, a run that failed before its
    # shutdown would leave it serving after the test process is gone
    script = (
        "import sys; from pathlib import Path; from bench.launch import ServerProcess; "
        "p = ServerProcess([sys.executable, '-c', 'import time; time.sleep(120)'], 1, "
        f"Path({str(tmp_path / 'log')!r}), {{}}).start(); print(p.proc.pid)"
    )
    pid = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             check=True).stdout)  # fmt: skip
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # (a zombie has exited)
