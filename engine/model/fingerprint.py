"""A model's fingerprint: the identity of its weights that its KV namespace carries, so
KV computed by one model is never served to another."""

from __future__ import annotations

import json

import torch
import xxhash
from transformers import PretrainedConfig, PreTrainedModel

# Config keys that change on save/load but not the computation (dtype is hashed separately).
_VOLATILE_CONFIG_KEYS = (
    "_name_or_path",
    "transformers_version",
    "architectures",
    "dtype",
    "torch_dtype",
    "_commit_hash",
    "_attn_implementation_autoset",
)


def config_digest_input(config: PretrainedConfig) -> bytes:
    """The config as sorted JSON, without the keys that save/load rewrites."""
    data = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    data["model_class"] = config.__class__.__name__
    return json.dumps(data, sort_keys=True, default=str).encode()


def fingerprint(model: PreTrainedModel, model_revision: str | None = None) -> str:
    """xxh3-128 over config, dtype and every tensor (name, dtype, shape, bytes); hex string.

    With `model_revision`, the weights are pinned by that string instead of being hashed.
    """
    dtype = next(model.parameters()).dtype
    h = xxhash.xxh3_128(config_digest_input(model.config))
    h.update(str(dtype).encode())
    if model_revision is not None:
        h.update(b"revision\x00" + model_revision.encode())
        return h.hexdigest()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().contiguous().reshape(-1)
        h.update(f"{name}\x00{t.dtype}\x00{tuple(tensor.shape)}\x00".encode())
        h.update(t.cpu().view(torch.uint8).numpy().data)
    return h.hexdigest()
