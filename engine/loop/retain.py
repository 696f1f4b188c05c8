"""What a request asked the cache to keep (`Request.retention`: Anthropic `cache_control`
breakpoints, OpenAI `prompt_cache_retention`), asked of the cache once its prompt's K/V is
in the index (kvstore/retention.py)."""

from __future__ import annotations

from engine.loop.request import Request
from kvstore.cache import PrefixCache


def retain_prompt(
    cache: PrefixCache, request: Request, start: int = 0, num_new: int | None = None
) -> int:
    """Retain each of the request's prefixes once its prompt is computed: when a step row of
    tokens [start, start + num_new) computed the prompt's last one (a whole run: None).
    Returns the device blocks retained."""
    if num_new is not None and not start < len(request.token_ids) <= start + num_new:
        return 0
    kept = 0
    for retain in request.retention:
        prefix = request.token_ids[: retain.num_tokens]
        tenant = request.tenant or ""
        result = cache.retain(prefix, retain.ttl_s, request.cache_salt, tenant, request.keys)
        kept += result.num_device_blocks
    return kept
