"""The serving engine on HF transformers: model loading, generate with prefix caching, CLI.

Names are imported lazily so that `kvstore` subcommands not needing transformers start fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "engine.loop.engine",
    "EngineClosedError": "engine.loop.engine",
    "GenerateResult": "engine.loop.engine",
    "InvalidRequestError": "engine.loop.engine",
    "SamplingParams": "engine.loop.engine",
    "reference_generate": "engine.loop.sequential",
    "LoadedModel": "engine.model.loading",
    "ModelLoadError": "engine.model.loading",
    "UnsupportedModelError": "engine.model.loading",
    "byte_tokenizer": "engine.model.tiny",
    "load_model": "engine.model.loading",
    "tiny_config": "engine.model.tiny",
    "wrap_model": "engine.model.loading",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
