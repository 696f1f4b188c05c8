"""GGUF files into cached HF directories: converted once, loaded by path after, safe to
convert from two processes at once; and a clear error for each way a file can be wrong."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from gguf_helpers import write_tiny_llama_gguf

from engine.loop.sequential import reference_generate
from engine.model.files import ModelLoadError
from engine.model.gguf import (
    BUILTINS,
    SOURCE_FILE,
    _checked,
    converted_dir,
    file_sha256,
    gguf_architecture,
)
from engine.model.loading import load_model


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def test_a_gguf_file_is_converted_once_and_loaded_by_path_after(tiny_gguf, cache):
    first = load_model(str(tiny_gguf))
    (directory,) = (cache / "models").iterdir()
    source = json.loads((directory / SOURCE_FILE).read_text())
    assert source["sha256"] == file_sha256(tiny_gguf) and source["gguf"] == str(tiny_gguf)
    assert directory.name == f"tiny-llama-{source['sha256'][:16]}"
    mtime = (directory / "config.json").stat().st_mtime_ns
    again = load_model(str(tiny_gguf))
    assert (directory / "config.json").stat().st_mtime_ns == mtime  # not converted again
    assert first.fingerprint == again.fingerprint
    assert first.layout.num_layers == 2 and first.layout.num_kv_heads == 2
    text = first.tokenizer.apply_chat_template(
        [{"role": "user", "content": "the theme"}], add_generation_prompt=True, tokenize=False
    )
    ids = first.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert first.tokenizer.decode(ids) == text
    assert text.endswith("<|im_start|>assistant\n") and ids.count(1) == 2  # <|im_start|>
    tokens, _ = reference_generate(first, list(ids), 4)
    assert tokens == reference_generate(again, list(ids), 4)[0]  # same weights


def test_the_converted_weights_are_the_files(tiny_gguf, cache):
    import gguf

    model = load_model(str(tiny_gguf)).model
    reader = gguf.GGUFReader(str(tiny_gguf))
    (embd,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    want = torch.from_numpy(embd.data.copy()).reshape(model.get_input_embeddings().weight.shape)
    assert torch.equal(model.get_input_embeddings().weight, want)


def _convert_in_child(path: str, cache_dir: str) -> str:
    os.environ["KVSTORE_CACHE_DIR"] = cache_dir
    return str(converted_dir(Path(path))[0])


def test_two_processes_converting_at_once_both_end_with_a_valid_directory(tmp_path):
    gguf_file = write_tiny_llama_gguf(tmp_path / "race.gguf", seed=3)
    cache_dir = str(tmp_path / "cache")
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        got = pool.starmap(_convert_in_child, [(str(gguf_file), cache_dir)] * 2)
    assert got[0] == got[1]
    entries = os.listdir(Path(cache_dir) / "models")
    assert entries == [Path(got[0]).name]  # no temporary directory left behind
    lm_dir = Path(got[0])
    assert json.loads((lm_dir / SOURCE_FILE).read_text())["sha256"] == file_sha256(gguf_file)
    assert load_model(str(lm_dir)).layout.num_layers == 2


def test_a_truncated_file_is_one_error_saying_so(tiny_gguf, tmp_path, cache):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match=r"cut.gguf is truncated or not a GGUF file"):
        load_model(str(cut))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError, match=r"junk.gguf is truncated or not a GGUF file"):
        load_model(str(junk))
    assert not (cache / "models").exists() or not os.listdir(cache / "models")


def test_an_unsupported_architecture_is_named(tmp_path, cache):
    odd = write_tiny_llama_gguf(tmp_path / "odd.gguf", arch="rwkv7")
    with pytest.raises(ModelLoadError, match=r"GGUF architecture 'rwkv7' is not supported.*llama"):
        gguf_architecture(odd)


def test_a_missing_file_and_a_wrong_builtin_file_are_errors(tmp_path, cache):
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        load_model(str(tmp_path / "absent.gguf"))
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"x" * 10)
    with pytest.raises(ModelLoadError, match="SHA-256 differs"):
        _checked(BUILTINS["smollm2"], fake)
