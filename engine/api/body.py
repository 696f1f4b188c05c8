"""A request's JSON body: refused over its byte limit (413) before or while it is read, and
strict JSON (no NaN, no lone surrogate) or a 400 that says what is wrong."""

from __future__ import annotations

import json

from starlette.requests import Request

from engine.api.errors import ApiError, bad_request


async def read_json(request: Request, limit: int) -> object:
    """The JSON body, refusing more than `limit` bytes (413) before or while reading it."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise ApiError(413, f"the request body is over the {limit}-byte limit", code="too_large")
    body, size = bytearray(), 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over the {limit}-byte limit")
        body += chunk
    try:
        data = json.loads(body, parse_constant=_not_json)
        json.dumps(data, ensure_ascii=False).encode()  # a lone surrogate (\ud800) is no text
    except UnicodeEncodeError:
        raise bad_request("the request body has a string that is not valid Unicode") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN or Infinity
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("the request body is not valid JSON: nested too deeply") from None
    return data


def _not_json(name: str) -> object:
    """Python's parser takes NaN, Infinity and -Infinity; JSON has no such values."""
    raise ValueError(f"{name} is not a JSON value")
