"""A new user's mistakes, through the real command line: one `error:` line that says what to
fix, exit status 2, no traceback, and nothing written."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import kvstore, only_error_line, run_module
from engine_helpers import micro_config
from gguf_helpers import write_tiny_llama_gguf

from engine.model.loading import byte_tokenizer

pytestmark = pytest.mark.integration
PROMPT = ["generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "2"]


def test_an_lmdb_dir_naming_a_file(tmp_path: Path) -> None:
    file = tmp_path / "kv"
    file.write_text("")
    line = only_error_line(kvstore(*PROMPT, "--lmdb-dir", str(file)), "kvstore generate")
    assert line == f"lmdb_dir: {file} exists and is not a directory; give a directory"


def test_an_lmdb_dir_that_cannot_be_created(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "kv"  # a directory under a file
    line = only_error_line(kvstore(*PROMPT, "--lmdb-dir", str(bad)), "kvstore generate")
    assert line == f"lmdb_dir: cannot create {bad} (Not a directory); give a writable directory"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_lmdb_dir_under_proc() -> None:
    line = only_error_line(kvstore(*PROMPT, "--lmdb-dir", "/proc/x"), "kvstore generate")
    assert line == (
        "lmdb_dir: cannot create /proc/x (No such file or directory); give a writable directory"
    )


def test_stats_with_an_lmdb_dir_naming_a_file(tmp_path: Path) -> None:
    file = tmp_path / "kv"
    file.write_text("")
    proc = kvstore("stats", "--namespace", "0123456789abcdef", "--lmdb-dir", str(file))
    line = only_error_line(proc, "kvstore stats")
    assert line == f"lmdb_dir: {file} exists and is not a directory; give a directory"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_device_without_cuda() -> None:
    line = only_error_line(kvstore(*PROMPT, "--device", "cuda"), "kvstore generate")
    assert line == (
        "device: 'cuda' requested but CUDA is not available (no GPU visible, or a CPU build "
        "of torch); use cpu or auto"
    )


def test_a_model_directory_without_tokenizer_files(tmp_path: Path) -> None:
    micro_config().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not weights")  # never read
    line = only_error_line(kvstore(*PROMPT, "--model", str(tmp_path)), "kvstore generate")
    assert line.startswith(f"--model {tmp_path}: no tokenizer files (none of: tokenizer.json, ")
    assert line.endswith("save the tokenizer there with tokenizer.save_pretrained(dir)")


def test_an_empty_model_directory(tmp_path: Path) -> None:
    line = only_error_line(kvstore(*PROMPT, "--model", str(tmp_path)), "kvstore generate")
    assert line == (
        f"--model {tmp_path}: not a model directory: it has no config.json "
        "(write one with model.save_pretrained(dir))"
    )


# The child runs the CLI's main, then says whether torch was imported on the way.
_MAIN_THEN_TORCH = """
import sys
from engine.cli import main
code = main(sys.argv[1:])
print(code, "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    "argv",
    [["generate", "--prompt", "hi"], ["demo"], ["serve", "--port", "0"],  # any free port
     ["router", "--replica", "http://a:1"]],
)  # fmt: skip
def test_a_bad_model_path_is_named_before_torch_is_imported(argv: list[str], tmp_path: Path):
    """Every command that takes --model checks its path first: one line in about a second,
    not after the seconds torch takes to import."""
    missing = tmp_path / "no-such-model"
    cmd = [sys.executable, "-c", _MAIN_THEN_TORCH, *argv, "--model", str(missing)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["2", "False"], proc.stderr[-3000:]  # exit 2, no torch
    assert proc.stderr == (
        f"kvstore {argv[0]}: error: --model {missing}: no such file or directory; give tiny, "
        "smollm2, dummy:NAME, a .gguf file or a model directory\n"
    )


def test_an_unknown_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "frobnicator"}))
    (tmp_path / "model.safetensors").write_bytes(b"not weights")  # never read
    byte_tokenizer().save_pretrained(tmp_path)
    line = only_error_line(kvstore(*PROMPT, "--model", str(tmp_path)), "kvstore generate")
    assert line.startswith(f"{tmp_path / 'config.json'}: model_type 'frobnicator' is unknown")
    assert line.endswith("; fix model_type or upgrade transformers")


def test_serve_without_the_serve_extra_names_it() -> None:
    proc = kvstore("serve", "--model", "tiny", blocked=("fastapi",))
    assert only_error_line(proc, "kvstore serve") == (
        "module 'fastapi' is not installed; install the 'serve' extra: pip install -e '.[serve]' "
        "in a checkout, or pip install 'kvstore-llm[serve]'"
    )


def test_the_quickstart_install_is_enough_for_generate(tmp_path: Path, monkeypatch) -> None:
    # pip install -e '.[engine]': none of the other extras' own modules (httpx comes with
    # transformers, through huggingface_hub)
    others = ("fastapi", "uvicorn", "matplotlib", "hypothesis")
    proc = kvstore(*PROMPT, "--ignore-eos", "--json", blocked=others)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads(proc.stdout)["output_token_ids"]) == 2
    # and a GGUF model, converted on the way, as the README's demo does with smollm2
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path / "cache"))
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    proc = kvstore(*PROMPT, "--ignore-eos", "--json", "--model", str(model), blocked=others)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads(proc.stdout)["output_token_ids"]) == 2


def test_generate_without_the_engine_extra_names_it() -> None:
    proc = kvstore(*PROMPT, blocked=("transformers",))
    assert only_error_line(proc, "kvstore generate") == (
        "module 'transformers' is not installed; install the 'engine' extra: "
        "pip install -e '.[engine]' in a checkout, or pip install 'kvstore-llm[engine]'"
    )


def test_bench_hitrate_out_without_matplotlib_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["hitrate", "--workload", "shared-prefix", "--capacity-blocks", "8", "--policy",
            "lru", "--out", str(out)]  # fmt: skip
    proc = run_module("bench", *argv, blocked=("matplotlib",))
    assert only_error_line(proc, "python -m bench hitrate") == (
        "module 'matplotlib' is not installed (needed by --out); install the 'bench' extra: "
        "pip install -e '.[bench]' in a checkout, or pip install 'kvstore-llm[bench]'"
    )
    assert not out.exists()


def test_serve_on_a_port_in_use_fails_at_once_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # torch blocked: the port is checked before anything would import it or load a model
        proc = kvstore("serve", "--port", str(port), blocked=("torch",))
    assert only_error_line(proc, "kvstore serve") == (
        f"port: cannot listen on 127.0.0.1:{port}: Address already in use"
    )


def test_a_gguf_model_without_the_gguf_package_names_the_extra(tmp_path: Path) -> None:
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    proc = kvstore(*PROMPT, "--model", str(model), blocked=("gguf",))
    assert only_error_line(proc, "kvstore generate") == (
        "module 'gguf' is not installed; install the 'engine' extra: pip install -e '.[engine]' "
        "in a checkout, or pip install 'kvstore-llm[engine]'"
    )


def test_a_gguf_model_that_cannot_be_converted_is_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path / "cache"))
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    proc = kvstore(*PROMPT, "--model", str(model), blocked=("accelerate",))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    progress, line = proc.stderr.strip().splitlines()  # "converting ... (once)", then why not
    assert progress.startswith("kvstore: converting tiny.gguf into ")
    assert line.startswith(f"kvstore generate: error: cannot convert {model}: ")
    assert "accelerate is required" in line
    assert os.listdir(tmp_path / "cache" / "models") == []  # no half-converted directory


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--prompt", ""], "--prompt is empty; give the question's text"),
        (["--prompt-ids", "a,b"], "--prompt-ids must be comma-separated ints, got 'a,b'"),
        (["--prompt-ids", ","], "--prompt-ids is empty; give at least one token id"),
        (["--prompt", "hi", "--raw", "--system", "be brief"],
         "--system goes with --prompt through the chat template (not with --raw or "
         "--prompt-ids)"),
    ],
)  # fmt: skip
def test_generate_refuses_a_bad_prompt_before_torch_loads(argv, error):
    cmd = [sys.executable, "-c", _MAIN_THEN_TORCH, "generate", "--model", "tiny", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["2", "False"], proc.stderr[-3000:]  # exit 2, no torch
    assert proc.stderr == f"kvstore generate: error: {error}\n"
