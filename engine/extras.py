"""Optional dependencies (the extras of pyproject.toml): the one-line error that says which
extra to install when a command or an option needs a module that is not installed.

Commands check their modules before they do anything (`require`), so a missing extra never
leaves partial output behind; `as_missing_extra` turns an ImportError met later into the same
error.
"""

from __future__ import annotations

import importlib
import importlib.util

# The distribution's name on the package index ("kvstore" there is an unrelated project).
DISTRIBUTION = "kvstore-llm"

# Top-level module -> the extra that installs it (README.md, "Commands").
EXTRA_OF_MODULE = {
    "transformers": "engine",
    "gguf": "engine",
    "fastapi": "serve",
    "uvicorn": "serve",
    "httpx": "serve",
    "zmq": "serve",  # KV events (kvstore serve --kv-events-port, kvstore router)
    "msgspec": "serve",
    "matplotlib": "bench",
    "hypothesis": "bench",
    "accelerate": "engine",  # GGUF loading; bench's transformers serve peer needs it too
}


class MissingExtraError(ImportError):
    """An optional module is not installed; `extra` names what installs it."""

    def __init__(self, module: str, extra: str, needed_by: str | None = None):
        by = f" (needed by {needed_by})" if needed_by else ""
        super().__init__(
            f"module {module!r} is not installed{by}; install the {extra!r} extra: "
            f"pip install -e '.[{extra}]' in a checkout, or pip install '{DISTRIBUTION}[{extra}]'",
            name=module,
        )
        self.module, self.extra = module, extra


def require(*modules: str, needed_by: str | None = None) -> None:
    """`MissingExtraError` for the first of `modules` that is not installed. Found, not
    imported: flags are checked before torch and transformers take seconds to load."""
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise MissingExtraError(module, EXTRA_OF_MODULE[module], needed_by)


def as_missing_extra(error: ImportError) -> MissingExtraError | None:
    """The `MissingExtraError` of an ImportError of an optional module, else None."""
    if isinstance(error, MissingExtraError):
        return error
    module = (error.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(module)
    return None if extra is None else MissingExtraError(module, extra)
