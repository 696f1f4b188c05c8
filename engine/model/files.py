"""What a local model directory must hold, checked before any weight is read.

A directory is loadable when it has a `config.json` whose `model_type` this transformers
knows, tokenizer files and weights. Each failure is a `ModelLoadError` that says what is
missing and how to fix it, instead of the error transformers would raise later (after the
weights loaded, or naming a package the directory does not need). `check_model_path` checks
the files alone, before torch is imported: a command's bad --model fails in a second.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import transformers  # its Auto classes import torch: loaded where used

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Files holding a vocabulary, by tokenizer kind (one group is enough).
TOKENIZER_FILE_GROUPS = (
    ("tokenizer.json",),  # fast tokenizers (what save_pretrained writes)
    ("tokenizer.model",),  # sentencepiece (Llama, Mistral, Gemma)
    ("spiece.model",),  # sentencepiece (T5 family)
    ("vocab.json", "merges.txt"),  # byte-level BPE (GPT-2 family)
    ("vocab.txt",),  # WordPiece
)
# Weights as `from_pretrained` finds them in a directory (one is enough).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")  # fmt: skip


class ModelLoadError(ValueError):
    """The model name or path cannot be loaded (not `tiny` and not a local model directory)."""


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def read_config(path: Path) -> PretrainedConfig:
    """The directory's config; `ModelLoadError` if config.json is missing, unreadable or names
    a model type transformers does not know."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(
            f"{path} is not a model directory: it has no config.json "
            "(write one with model.save_pretrained(dir))"
        )
    try:
        model_type = json.loads(file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"cannot read {file}: {_one_line(e)}") from None
    if model_type not in CONFIG_MAPPING:
        raise ModelLoadError(
            f"{file}: model_type {model_type!r} is unknown to transformers "
            f"{transformers.__version__}; fix model_type or upgrade transformers"
        )
    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load {file}: {_one_line(e)}") from None


def attn_implementation(config: PretrainedConfig) -> str:
    """`sdpa` where the model's class supports it, else `eager` (GPT-J, Bloom)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None:
        model_type = getattr(config, "model_type", "unknown")
        raise ModelLoadError(f"model type {model_type!r} has no causal-LM class in transformers")
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def missing_tokenizer_files(path: Path) -> str | None:
    """None when `path` has the files of some tokenizer kind, else which ones it lacks."""
    if any(all((path / name).is_file() for name in group) for group in TOKENIZER_FILE_GROUPS):
        return None
    return ", ".join(" + ".join(group) for group in TOKENIZER_FILE_GROUPS)


def load_tokenizer(path: Path, tokenizer_class: type | None = None) -> Any:
    """The directory's tokenizer, by `tokenizer_class` (default `AutoTokenizer`, which imports
    torch); `ModelLoadError` naming the missing files if it has none."""
    missing = missing_tokenizer_files(path)
    if missing is not None:
        raise ModelLoadError(
            f"{path} has no tokenizer files (none of: {missing}); save the tokenizer there "
            "with tokenizer.save_pretrained(dir)"
        )
    try:
        loader = tokenizer_class or transformers.AutoTokenizer
        return loader.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, ImportError) as e:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {_one_line(e)}") from None


def check_model_path(name: str, flag: str, names: Sequence[str], weights: bool = True) -> None:
    """`ModelLoadError` naming `flag` unless `name` is one of `names` (built-in models), an
    existing `.gguf` file, or a directory with a readable config.json, tokenizer files and
    (with `weights`) weights. Only the files are looked at: no torch, no transformers model."""
    if name in names:
        return
    problem = _path_problem(name, names, weights)
    if problem is not None:
        raise ModelLoadError(f"{flag} {name}: {problem}")


def _path_problem(name: str, names: Sequence[str], weights: bool) -> str | None:
    """What is wrong with `name` as a model path, read as the loaders read it (a `.gguf`
    name is a GGUF file, anything else a directory); None when nothing is."""
    if name.endswith(".gguf"):
        found = Path(name).expanduser().is_file()
        return None if found else "no such GGUF file; give the path of a .gguf file"
    path = Path(name)
    if path.is_file():
        return "a file but not a .gguf file; give a .gguf file or a model directory"
    if not path.is_dir():
        known = ", ".join(names)
        return f"no such file or directory; give {known}, a .gguf file or a model directory"
    return _directory_problem(path, weights)


def _directory_problem(path: Path, weights: bool) -> str | None:
    problem = _config_problem(path / "config.json") if weights else None
    if problem is not None:
        return problem
    missing = missing_tokenizer_files(path)
    if missing is not None:
        return (
            f"no tokenizer files (none of: {missing}); save the tokenizer there with "
            "tokenizer.save_pretrained(dir)"
        )
    if weights and not any((path / name).is_file() for name in WEIGHT_FILES):
        return (
            f"no weights (none of: {', '.join(WEIGHT_FILES)}); write them there with "
            "model.save_pretrained(dir)"
        )
    return None


def _config_problem(file: Path) -> str | None:
    if not file.is_file():
        return (
            "not a model directory: it has no config.json (write one with "
            "model.save_pretrained(dir))"
        )
    try:
        json.loads(file.read_text())
    except (OSError, ValueError) as e:
        return f"cannot read its config.json ({_one_line(e)}); fix it or write it again"
    return None
