"""The `kvstore` console script: generate, flag -> CacheConfig mapping, the default model,
the --model check, errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.cli import COMMANDS, build_parser, config_from_args, main
from engine.model.files import ModelLoadError, check_model_path
from engine.model.loading import load_model


def kvstore_script() -> str:
    return str(Path(sys.executable).with_name("kvstore"))


@pytest.mark.integration
def test_generate_json_via_the_console_script() -> None:
    cmd = [kvstore_script(), "generate", "--model", "tiny", "--prompt-ids",
           "72,101,108,108,111,44,32,119", "--max-tokens", "6", "--ignore-eos", "--block-size",
           "4", "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(proc.stdout)
    assert set(out) >= {"prompt_tokens", "cached_tokens", "output_token_ids", "text"}
    assert (out["prompt_tokens"], out["cached_tokens"]) == (8, 0)
    tiny = load_model("tiny")
    with torch.inference_mode():
        ref = tiny.model.generate(
            torch.tensor([[72, 101, 108, 108, 111, 44, 32, 119]]),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=None,
        )
    assert out["output_token_ids"] == ref[0, 8:].tolist()
    assert out["text"] == tiny.tokenizer.decode(out["output_token_ids"], skip_special_tokens=True)


def test_cache_flags_map_to_cache_config_fields(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["generate", "--prompt", "hi", "--block-size", "8", "--device-blocks", "32",
         "--device-cache-gb", "0.5", "--lmdb-dir", str(tmp_path), "--redis-url",
         "redis://localhost:6379/0", "--eviction-policy", "lfu"]
    )  # fmt: skip
    config = config_from_args(args)
    assert (config.block_size, config.device_blocks, config.device_cache_gb) == (8, 32, 0.5)
    assert (config.lmdb_dir, config.redis_url) == (str(tmp_path), "redis://localhost:6379/0")
    assert config.eviction_policy == "lfu"
    assert config.memory_cache_gb == 0.0  # unset flags keep CacheConfig defaults


def test_secret_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_SECRET", "s3cret")
    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert config_from_args(args).secret == "s3cret"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--prompt-ids", "1,x"], "--prompt-ids must be comma-separated ints"),
        (["generate", "--prompt-ids", "1,2", "--block-size", "0"], "block_size"),
        (["generate", "--model", "tiny", "--prompt-ids", "1,999"], r"\[0, 260\)"),
        (
            ["generate", "--prompt", "hi", "--model", "no/such/dir"],
            "--model no/such/dir: no such file or directory; give tiny, smollm2",
        ),
    ],
)
def test_user_errors_exit_2_with_a_message(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvstore {argv[0]}: error:")
    assert re.search(message, err)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--prompt", "hi", "--max-tokens", "0"],
         "argument --max-tokens: must be a positive integer, got 0"),
        (["generate", "--prompt", "hi", "--max-num-seqs", "-3"],
         "argument --max-num-seqs: must be a positive integer, got -3"),
        (["serve", "--max-num-batched-tokens", "-1"],
         "argument --max-num-batched-tokens: must be a positive integer, got -1"),
        (["generate", "--promt", "hi"], "unknown flag --promt; did you mean --prompt?"),
    ],
)  # fmt: skip
def test_flag_errors_are_one_line_before_anything_loads(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()  # the message, not 20 lines of usage
    assert line == f"kvstore {argv[0]}: error: {message} (see kvstore {argv[0]} --help)"


def test_subcommands_are_registered_in_one_table() -> None:
    assert {"generate", "demo"} <= set(COMMANDS)


def test_a_prompt_shorter_than_a_block_is_told_it_cannot_hit(capsys) -> None:
    argv = ["generate", "--model", "tiny", "--prompt-ids", "1,2,3", "--max-tokens", "2",
            "--ignore-eos"]  # fmt: skip
    assert main([*argv, "--block-size", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "note: the prompt has 3 tokens, fewer than one cache block (4): a repeat of it cannot "
        "hit the cache, since hits are whole blocks (--block-size sets their size)"
    )
    assert main([*argv, "--block-size", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("[3 prompt tokens, 0 cached, ")


def test_every_flag_says_what_it_does() -> None:
    parser = build_parser()
    subparsers = parser._subparsers._group_actions[0].choices
    for name in ("generate", "demo", "serve", "stats", "clear"):
        for action in subparsers[name]._actions:
            assert action.help and not action.help.startswith("default:"), (name, action.dest)
    assert "random weights" in subparsers["generate"].description
    assert "SmolLM2-135M-Instruct" in subparsers["demo"].description


def test_generate_defaults_to_demos_model_and_both_helps_name_it() -> None:
    """A new user's `kvstore generate --prompt ...` answers with the real model, not tiny's
    noise; stats and clear find what generate stored with the same flags."""
    parser = build_parser()
    subparsers = parser._subparsers._group_actions[0].choices
    defaults = {name: parser.parse_args([name, *extra]).model for name, extra in [
        ("generate", ["--prompt", "hi"]), ("demo", []), ("stats", []), ("clear", []),
        ("serve", []), ("router", ["--replica", "http://a:1"])]}  # fmt: skip
    assert defaults == {"generate": "smollm2", "demo": "smollm2", "stats": "smollm2",
                        "clear": "smollm2", "serve": "tiny", "router": "tiny"}  # fmt: skip
    for name in ("generate", "demo"):
        (model,) = [a for a in subparsers[name]._actions if a.dest == "model"]
        assert model.help.endswith("(default: smollm2)")
    assert "default smollm2" in subparsers["generate"].description


# --- the --model check (before torch: engine/model/files.py) --------------------------------

NAMES = ("tiny", "smollm2")


def model_error(name: str, weights: bool = True) -> str:
    with pytest.raises(ModelLoadError) as error:
        check_model_path(name, "--model", NAMES, weights)
    return str(error.value)


def test_the_model_check_names_the_flag_the_path_and_the_fix(tmp_path: Path) -> None:
    text, empty = tmp_path / "weights.txt", tmp_path / "empty"
    text.write_text("x")
    empty.mkdir()
    assert model_error(str(tmp_path / "nope")) == (
        f"--model {tmp_path / 'nope'}: no such file or directory; give tiny, smollm2, a .gguf "
        "file or a model directory"
    )
    assert model_error(str(tmp_path / "m.gguf")) == (
        f"--model {tmp_path / 'm.gguf'}: no such GGUF file; give the path of a .gguf file"
    )
    assert model_error(str(text)) == (
        f"--model {text}: a file but not a .gguf file; give a .gguf file or a model directory"
    )
    assert model_error(str(empty)) == (
        f"--model {empty}: not a model directory: it has no config.json (write one with "
        "model.save_pretrained(dir))"
    )
    (empty / "config.json").write_text("{not json")
    assert model_error(str(empty)).startswith(f"--model {empty}: cannot read its config.json (")


def test_the_model_check_wants_tokenizer_files_and_weights_where_loading_reads_them(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    no_tokenizer = model_error(str(tmp_path))
    assert no_tokenizer.startswith(f"--model {tmp_path}: no tokenizer files (none of: tokenizer")
    assert no_tokenizer.endswith("; save the tokenizer there with tokenizer.save_pretrained(dir)")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert model_error(str(tmp_path)) == (
        f"--model {tmp_path}: no weights (none of: model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json); "
        "write them there with model.save_pretrained(dir)"
    )
    check_model_path(str(tmp_path), "--model", NAMES, weights=False)  # a router's tokenizer
    (tmp_path / "model.safetensors").write_bytes(b"never read")
    check_model_path(str(tmp_path), "--model", NAMES)
    for name in NAMES:  # built-in names, not paths
        check_model_path(name, "--model", NAMES)


def generate_json(capsys, *argv: str) -> tuple[dict, str]:
    """`kvstore generate --json` in this process (the command's own code, as the script runs
    it): its JSON answer and its stderr."""
    capsys.readouterr()
    assert main(["generate", "--max-tokens", "2", "--json", *argv]) in (0, None)
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_generate_sends_a_prompt_through_the_chat_template_unless_raw(tmp_path, capsys) -> None:
    """`--prompt` is one user message (after `--system`) through the model's template;
    `--raw` and `--prompt-ids` go as they are; a model without a template goes raw and
    says so once."""
    tiny = load_model("tiny")
    tok = tiny.tokenizer
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    templated = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    out, _ = generate_json(capsys, "--model", "tiny", "--prompt", "hello", "--system", "be brief")
    assert (out["prompt"], out["prompt_tokens"]) == (
        "chat",
        len(tok(templated, add_special_tokens=False)["input_ids"]),
    )
    out, _ = generate_json(capsys, "--model", "tiny", "--prompt", "hello", "--raw")
    assert (out["prompt"], out["prompt_tokens"]) == ("raw", len(tok("hello")["input_ids"]))
    out, _ = generate_json(capsys, "--model", "tiny", "--prompt-ids", "1,2,3")
    assert (out["prompt"], out["prompt_tokens"]) == ("raw", 3)
    tok.chat_template = None  # a bare directory: weights and a tokenizer with no template
    tiny.model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    out, err = generate_json(capsys, "--model", str(tmp_path), "--prompt", "hello")
    assert out["prompt"] == "raw"
    assert err.count("no chat template") == 1
