"""The serving engine on HF transformers: model loading, generate with prefix caching, CLI.

Names are imported lazily so that `kvstore` subcommands not needing transformers start fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "engine.engine",
    "EngineClosedError": "engine.engine",
    "GenerateResult": "engine.engine",
    "InvalidRequestError": "engine.engine",
    "SamplingParams": "engine.engine",
    "reference_generate": "engine.sequential",
    "LoadedModel": "engine.model",
    "ModelLoadError": "engine.model",
    "UnsupportedModelError": "engine.model",
    "byte_tokenizer": "engine.tiny_model",
    "load_model": "engine.model",
    "tiny_config": "engine.tiny_model",
    "wrap_model": "engine.model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
