"""API-key authentication (`Authorization: Bearer <key>`, or Anthropic's `x-api-key`),
tenants, and the cache salt each request runs under.

A tenant's salt is derived on the server from its name and the deployment secret, so tenants
never share cached blocks unless their keys name the same tenant. A request's own
`cache_salt` can only narrow sharing further: the engine gets
`combine_salts(tenant_salt, cache_salt)`. The replica server and the router derive them alike.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping

from starlette.requests import Request

from engine.api.errors import ApiError, bad_request
from hashing import combine_salts, validate_salt

SALT_DOMAIN = b"kvstore-tenant-salt-v1"


class AuthError(Exception):
    """No valid API key; the message says what is wrong (answered with 401)."""


class CacheSaltError(ValueError):
    """A request's cache_salt is invalid (answered with 400)."""


def _frame(value: bytes) -> bytes:
    return struct.pack("<I", len(value)) + value


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def tenant_salt(tenant: str, secret: bytes) -> str:
    """32 hex digits: keyed BLAKE2b of the framed (domain, tenant name)."""
    key = secret if len(secret) <= 64 else hashlib.blake2b(secret).digest()
    h = hashlib.blake2b(_frame(SALT_DOMAIN) + _frame(tenant.encode()), key=key, digest_size=16)
    return h.hexdigest()


def request_salt(base_salt: str, cache_salt: object) -> str:
    """The engine salt of a request: its validated `cache_salt` narrowing `base_salt`."""
    if cache_salt is None:
        cache_salt = ""
    if not isinstance(cache_salt, str):
        raise CacheSaltError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    try:
        validate_salt(cache_salt)
    except ValueError as e:
        raise CacheSaltError(f"cache_{e}") from None  # "salt ..." names the field
    return combine_salts(base_salt, cache_salt)


class Authenticator:
    """Maps an API key (`Authorization: Bearer <key>` or `x-api-key: <key>`) to a tenant.
    Without keys everyone is tenant None, whose salt is empty (the config's namespace, as
    `kvstore generate` uses)."""

    def __init__(self, api_keys: Mapping[str, str], secret: bytes):
        self._tenants = {_key_digest(k): t for k, t in api_keys.items()}  # looked up by digest
        self._salts = {t: tenant_salt(t, secret) for t in set(api_keys.values())}

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    @property
    def tenants(self) -> list[str]:
        return sorted(self._salts)

    def tenant(self, authorization: str | None, api_key: str | None = None) -> str | None:
        """The tenant of an Authorization header, else of an x-api-key header; raises
        AuthError when a key is required."""
        if not self.enabled:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            key = api_key or ""
        if not key.strip():
            why = "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            raise AuthError(why)
        tenant = self._tenants.get(_key_digest(key.strip()))
        if tenant is None:
            raise AuthError("invalid API key")
        return tenant

    def salt(self, tenant: str | None) -> str:
        return "" if tenant is None else self._salts[tenant]


def authenticate(auth: Authenticator, request: Request) -> str | None:
    """The request's tenant; a 401 ApiError without a valid key (when keys are set)."""
    try:
        headers = request.headers
        return auth.tenant(headers.get("authorization"), headers.get("x-api-key"))
    except AuthError as e:
        error = ApiError(401, str(e), type="authentication_error", code="invalid_api_key")
        raise error from None


def engine_salt(auth: Authenticator, tenant: str | None, cache_salt: object) -> str:
    """The salt a tenant's request runs under; a 400 ApiError for an invalid `cache_salt`."""
    try:
        return request_salt(auth.salt(tenant), cache_salt)
    except CacheSaltError as e:
        raise bad_request(str(e), "cache_salt") from None
