"""API keys as configured: a keys file of {key: tenant}, `--api-key` or $KVSTORE_API_KEY
(tenant `default`), each checked. The server and the router read them alike (`auth` turns
them into tenants and salts per request). Standard library only, so a flag error is
reported before anything heavy loads.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path

from kvstore.config import ConfigError

DEFAULT_TENANT = "default"  # the tenant of --api-key
MAX_TENANT_CHARS = 64
API_KEY_ENV = "KVSTORE_API_KEY"


def check_api_key(key: object) -> str:
    """An API key: a non-empty string of printable, non-space characters."""
    if not isinstance(key, str) or not key.isprintable() or not key.split() == [key]:
        raise ConfigError("api_keys", "an API key must be non-empty printable text without spaces")
    return key


def check_tenant(tenant: object) -> str:
    if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_CHARS:
        raise ConfigError("api_keys", f"a tenant is 1..{MAX_TENANT_CHARS} characters: {tenant!r}")
    if not tenant.isprintable():
        raise ConfigError("api_keys", f"a tenant must be printable text: {tenant!r}")
    return tenant


def load_api_keys(path: str | Path) -> dict[str, str]:
    """Read an API keys file: one JSON object {"<api key>": "<tenant name>", ...}.

    Keys that map to the same tenant share that tenant's cache and queue.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError("api_keys_file", f"cannot read JSON from {path}: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError("api_keys_file", f'{path} must hold a non-empty {{"key": "tenant"}}')
    return {check_api_key(k): check_tenant(v) for k, v in data.items()}


def api_keys_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, str]:
    """{key: tenant} of --api-keys-file and --api-key (else $KVSTORE_API_KEY, tenant
    `default`)."""
    keys: dict[str, str] = {}
    if args.api_keys_file:
        keys.update(load_api_keys(args.api_keys_file))
    single = args.api_key if args.api_key is not None else env.get(API_KEY_ENV)
    if single:
        keys[check_api_key(single)] = DEFAULT_TENANT
    return keys
