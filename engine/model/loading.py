"""Load a causal LM (the pinned `tiny` model, a built-in or GGUF model, or a local directory)
and wrap it with what its KV namespace needs: its KV shape and fingerprint.

A model is cacheable only if every layer is full or sliding-window attention whose K and V
share one head dim; anything else raises `UnsupportedModelError` naming the layer type, never
silent wrong KV. Window layers keep every position's K/V; the window is a mask.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from engine.loop.threads import on_own_thread
from engine.model.dummy import (
    build_dummy,
    dummy_dtype,
    dummy_revision,
    dummy_shape,
    dummy_tokenizer_dir,
)
from engine.model.files import ModelLoadError, attn_implementation, load_tokenizer, read_config
from engine.model.fingerprint import fingerprint
from engine.model.gguf import BUILTINS, gguf_model_dir
from engine.model.tiny import BYTE_VOCAB_SIZE as BYTE_VOCAB_SIZE  # importable from here too
from engine.model.tiny import TINY_NAME, byte_tokenizer, random_model, tiny_config
from hashing import Namespace
from kvstore.layout import DTYPES as KV_DTYPES

DTYPES = KV_DTYPES | {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_RECURRENT_CONFIG_KEYS = ("ssm_state_size", "mamba_d_state", "state_size", "layers_block_type")


class UnsupportedModelError(ValueError):
    """The model has layers whose KV cannot be prefix-cached; `layer_type` names the first one."""

    def __init__(self, model_type: str, layer_type: str, detail: str = ""):
        msg = f"model type {model_type!r} has unsupported layer type {layer_type!r}"
        hint = (
            "; kvstore caches only models whose every layer is full or sliding-window "
            "attention (equal K/V dims)"
        )
        super().__init__(msg + (f": {detail}" if detail else "") + hint)
        self.model_type = model_type
        self.layer_type = layer_type


# Layer types whose K/V the pool holds per position (a window is a mask over them).
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    return config.get_text_config(decoder=True)


def has_window(config: PretrainedConfig) -> bool:
    """Whether some layer of the model attends through a sliding window."""
    cfg = _text_config(config)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return "sliding_attention" in layer_types
    window = getattr(cfg, "sliding_window", None)
    return window is not None and getattr(cfg, "use_sliding_window", True) is not False


def shared_window(config: PretrainedConfig) -> int | None:
    """The sliding window (tokens) of every attention layer; None when some layer attends
    to the whole prefix (a full or hybrid model)."""
    cfg = _text_config(config)
    window = getattr(cfg, "sliding_window", None)
    if not has_window(config) or not isinstance(window, int) or window < 1:
        return None
    layer_types = getattr(cfg, "layer_types", None) or ()
    if any(layer_type != "sliding_attention" for layer_type in layer_types):
        return None
    return window


def hybrid_window(config: PretrainedConfig) -> tuple[int, list[int]] | None:
    """A hybrid model's sliding window (tokens) and its window layers' indices, when some
    layers attend through the window and others to the whole prefix; None otherwise."""
    cfg = _text_config(config)
    window, layer_types = getattr(cfg, "sliding_window", None), getattr(cfg, "layer_types", None)
    if not layer_types or not isinstance(window, int) or window < 1:
        return None
    layers = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    return (window, layers) if 0 < len(layers) < len(layer_types) else None


def model_window(config: PretrainedConfig) -> int | None:
    """The sliding window of a window-only or hybrid model (tokens), None for full
    attention."""
    hybrid = hybrid_window(config)
    return hybrid[0] if hybrid is not None else shared_window(config)


def check_supported(config: PretrainedConfig) -> None:
    """Raise `UnsupportedModelError` unless every layer is full or sliding-window attention
    with equal K/V dims."""
    cfg = _text_config(config)
    model_type = getattr(cfg, "model_type", "") or "unknown"
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(model_type, "cross_attention", "encoder-decoder model")
    for layer_type in getattr(cfg, "layer_types", None) or ():
        if layer_type not in SUPPORTED_LAYER_TYPES:
            raise UnsupportedModelError(model_type, str(layer_type))
    if getattr(cfg, "attention_chunk_size", None) is not None:
        raise UnsupportedModelError(model_type, "chunked_attention")
    if any(getattr(cfg, key, None) is not None for key in _RECURRENT_CONFIG_KEYS) or any(
        name in model_type for name in ("mamba", "rwkv", "xlstm", "recurrent")
    ):
        raise UnsupportedModelError(model_type, "recurrent")
    v_dim, qk_dim = getattr(cfg, "v_head_dim", None), getattr(cfg, "qk_head_dim", None)
    if getattr(cfg, "kv_lora_rank", None) is not None or (v_dim and qk_dim and v_dim != qk_dim):
        raise UnsupportedModelError(
            model_type, "multi_latent_attention", "K and V head dims differ"
        )


@dataclass(frozen=True)
class KVShape:
    """The KV a model writes per token: layers x kv_heads x head_dim (with a block size and
    dtype, a namespace's `kvstore.layout.KVLayout`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@functools.cache
def _cache_keyword(model_cls: type) -> str:
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def with_cache(model: torch.nn.Module, past: DynamicCache) -> dict[str, DynamicCache]:
    """The forward keyword that takes a KV cache: `cache` from transformers 5.24 on (which
    deprecates `past_key_values`), `past_key_values` before."""
    return {_cache_keyword(type(model)): past}


def kv_cache(config: PretrainedConfig) -> DynamicCache:
    """A DynamicCache that keeps every position in every layer. HF's default truncates a
    sliding-window layer to its window; kvstore stores whole prefixes, so the window stays a
    mask (HF builds it from the config either way)."""
    past = DynamicCache(config=config)
    past.layers = [DynamicLayer() for _ in past.layers]
    return past


def probe_kv_layout(model: PreTrainedModel) -> KVShape:
    """Run one token and read the KV shapes the model really writes (per layer [1, H, 1, D])."""
    cfg, model_type = model.config, getattr(model.config, "model_type", "unknown")
    device = next(model.parameters()).device
    past = kv_cache(cfg)
    with torch.inference_mode():
        model(
            input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), **with_cache(model, past)
        )
    shapes = set()
    for layer in past.layers:
        if type(layer) is not DynamicLayer or layer.keys is None:
            raise UnsupportedModelError(model_type, type(layer).__name__)
        if layer.keys.shape[-1] != layer.values.shape[-1]:
            raise UnsupportedModelError(model_type, "multi_latent_attention", "K/V dims differ")
        shapes.add(tuple(layer.keys.shape))
    if len(shapes) != 1:
        raise UnsupportedModelError(model_type, "heterogeneous_attention", f"KV shapes {shapes}")
    _, heads, _, head_dim = shapes.pop()
    return KVShape(len(past.layers), heads, head_dim)


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for the engine, with what its KV namespace needs."""

    name: str
    model: PreTrainedModel
    tokenizer: Any
    fingerprint: str
    layout: KVShape
    vocab_size: int
    max_positions: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def kv_dtype(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def namespace(self, block_size: int, salt: str = "", codec: str = "none") -> Namespace:
        return Namespace(
            model_fingerprint=self.fingerprint,
            kv_dtype=self.kv_dtype,
            num_layers=self.layout.num_layers,
            num_kv_heads=self.layout.num_kv_heads,
            head_dim=self.layout.head_dim,
            block_size=block_size,
            codec=codec,
            salt=salt,
        )


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype by name; `auto` is float32 (a dummy model's is its own, `dummy_dtype`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _eos_ids(config: PretrainedConfig, tokenizer: Any) -> tuple[int, ...]:
    ids = getattr(_text_config(config), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(sorted(set(ids)))


def _max_positions(config: PretrainedConfig) -> int | None:
    cfg = _text_config(config)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(getattr(cfg, key, None), int):
            return getattr(cfg, key)
    return None


def wrap_model(
    model: PreTrainedModel, tokenizer: Any, name: str, model_revision: str | None = None
) -> LoadedModel:
    """Check, probe and fingerprint an in-memory causal LM."""
    check_supported(model.config)
    model.eval().requires_grad_(False)
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        fingerprint=fingerprint(model, model_revision),
        layout=probe_kv_layout(model),
        vocab_size=int(model.get_input_embeddings().num_embeddings),
        max_positions=_max_positions(model.config),
        eos_token_ids=_eos_ids(model.config, tokenizer),
    )


def _load_local(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, Any]:
    """Config, support check and tokenizer first: a bad directory fails before its weights
    are read. Attention is SDPA where the model supports it, else eager."""
    config = read_config(path)
    check_supported(config)
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, local_files_only=True, attn_implementation=attn_implementation(config)
    )
    return model, tokenizer


def load_model(
    name_or_path: str,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    model_revision: str | None = None,
) -> LoadedModel:
    """`tiny` builds the pinned model from a fixed seed; `dummy:NAME` a real model's shape
    with seeded weights on `device` (`engine.model.dummy`; dtype `auto`: bfloat16 on an
    accelerator); a built-in name (`smollm2`) or a `.gguf` file is converted once into a
    cached directory (`engine.model.gguf`); anything else is a local model directory.

    Loads on a thread of its own that ends with the loading: the caller's thread keeps no
    OpenMP team to slow an engine's steps down (engine/loop/threads.py)."""
    return on_own_thread(_load_model, name_or_path, dtype, device, model_revision)


def _load_model(
    name_or_path: str, dtype: str | torch.dtype, device: str | torch.device, revision: str | None
) -> LoadedModel:
    model_revision = revision
    torch_dtype = resolve_dtype(dtype)
    if (shape := dummy_shape(name_or_path)) is not None:
        on = torch.device(device)
        torch_dtype = dummy_dtype(on) if dtype == "auto" else torch_dtype
        model = build_dummy(shape, torch_dtype, on)  # built where it runs
        tokenizer = load_tokenizer(dummy_tokenizer_dir())
        model_revision = model_revision or dummy_revision(shape, on)
    elif name_or_path == TINY_NAME:
        model, tokenizer = random_model(tiny_config()), byte_tokenizer()
    elif (converted := gguf_model_dir(name_or_path)) is not None:
        directory, sha = converted
        model, tokenizer = _load_local(directory, torch_dtype)
        model_revision = model_revision or f"gguf-sha256:{sha}"  # weights pinned by the file
    elif Path(name_or_path).is_dir():
        model, tokenizer = _load_local(Path(name_or_path), torch_dtype)
    else:
        names = ", ".join([TINY_NAME, *BUILTINS, "dummy:NAME"])
        raise ModelLoadError(
            f"{name_or_path!r} is not a model: use {names}, a .gguf file or a model directory"
        )
    model = model.to(device=device, dtype=torch_dtype)
    return wrap_model(model, tokenizer, name_or_path, model_revision)
