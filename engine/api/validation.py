"""One validation layer for OpenAI's and Anthropic's request bodies, on the replica server and
the router alike: a body becomes its request model or a 400 whose `param` names the field as
the client sent it (`messages.0.content`, never pydantic's `stop.str`), with a message a
person can act on.

- Known fields are checked strictly (a "2" is no int, a "yes" no bool), ranges included.
- Fields the engine cannot honour are refused by the model's `unsupported()`.
- Unknown top-level fields are ignored, as vLLM ignores them, with a warning that names
  them, once per field name per process (`kvstore.api` logger): never dropped silently, and
  never read as something else.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pydantic import BaseModel, ValidationError

from engine.api.errors import bad_request

log = logging.getLogger("kvstore.api")
_warned: set[str] = set()  # unknown field names already announced (one warning each)
_warned_lock = threading.Lock()


def parse_body(model: type[BaseModel], data: object) -> Any:
    """Validate a JSON body into `model`; a 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    _warn_unknown(model, data)
    try:
        request = model.model_validate(data, strict=True)  # "1", 1.0 or true is no int
    except ValidationError as e:
        param, message = describe(e, data)
        raise bad_request(f"{param}: {message}" if param else message, param) from None
    for param, why in request.unsupported():  # type: ignore[attr-defined]
        raise bad_request(why, param, "unsupported_parameter")
    return request


def _warn_unknown(model: type[BaseModel], data: dict) -> None:
    unknown = sorted(str(k) for k in data if k not in model.model_fields)
    with _warned_lock:
        new = [name for name in unknown if name not in _warned]
        _warned.update(new)
    if new:
        log.warning("request fields %s are not part of the API: ignored", ", ".join(new))


def describe(error: ValidationError, data: object) -> tuple[str | None, str]:
    """The field the first error is about, as the client named it, and what is wrong:
    a union's failures as one message ("stop: expected a string or a list of strings")."""
    errors = error.errors()
    located = [(_param(e, data), e) for e in errors]
    # a union's member that got furthest into the client's value is the one it meant
    (param, value), first = max(located, key=lambda pe: len(pe[0][0] or ""))
    same = [e for (p, _), e in located if p == param]
    expected = _expected(same)
    if len(same) > 1 and expected:
        return param, f"expected {' or '.join(expected)}, got {_shown(value)}"
    return param, _plain(first["msg"])


def _param(error: dict, data: object) -> tuple[str | None, object]:
    """The error's path through the client's data, and the value there: a missing field
    ends it with its name; a union's member names, which pydantic adds, are not the
    client's: skipped."""
    parts: list[str] = []
    value = data
    loc = error["loc"]
    for i, step in enumerate(loc):
        if _holds(value, step):
            value = value[step]  # type: ignore[index]
        elif error["type"] == "missing" and i == len(loc) - 1:
            value = None
        elif isinstance(step, str) and not isinstance(value, dict):
            continue  # a union member's name
        else:
            break
        parts.append(str(step))
    return (".".join(parts) or None), value


def _holds(value: object, step: object) -> bool:
    """Whether the client's `value` has `step` (a key of an object, an index of a list)."""
    if isinstance(value, dict):
        return step in value
    return isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value)


# pydantic's "Input should be a valid X" -> what a client reads
_KINDS = {"string": "a string", "list": "a list", "integer": "an integer",
          "number": "a number", "boolean": "a boolean", "dictionary": "an object"}  # fmt: skip


def _expected(errors: list[dict]) -> list[str]:
    kinds = []
    for e in errors:
        msg = e["msg"]
        for word, kind in _KINDS.items():
            if msg.startswith(f"Input should be a valid {word}") and kind not in kinds:
                kinds.append(kind if word != "list" else _list_of(e))
    return kinds


def _list_of(error: dict) -> str:
    """A list member's wording: "a list of strings" when the loc says what it holds."""
    loc = [str(step) for step in error["loc"]]
    return "a list of strings" if "list[str]" in loc else "a list"


def _plain(message: str) -> str:
    """pydantic's message, its first letter lower-cased (it follows "field: ")."""
    return message[:1].lower() + message[1:]


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
