"""RedisStore: a shared spill tier on Redis (single server, TLS, ACL users, or Redis Cluster).

Keys are `kvs:<namespace id>:<block key hex>`; values are encoded entries. Every call is one
round trip: MGET (or one pipeline of GETs grouped per cluster node), a pipeline of EXISTS,
a pipeline of SET NX [EX ttl]. redis-py's retries are off and socket timeouts equal the
lookup deadline; a circuit breaker stops calling a failing server. Any failure reads as
misses or dropped writes and is counted, never raised.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry

from kvstore.stores.base import Changes, Counters, SpillStore, StoreStats
from kvstore.stores.breaker import CircuitBreaker, describe

T = TypeVar("T")
CLUSTER_SCHEMES = {"redis+cluster://": "redis://", "rediss+cluster://": "rediss://"}
SCHEMES = ("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES)
# Errors that mean "the server is unreachable or broken": they feed the circuit breaker.
_FAILURES = (RedisError, RedisClusterException, OSError)
_CONNECTION_FAILURES = (redis.ConnectionError, redis.TimeoutError, OSError)
_GLOB_CHARS = "*?[]\\"


def _clear_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames of `error` and of the errors it chains."""
    todo: list[BaseException | None] = [error]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is not None and id(e) not in seen:
            seen.add(id(e))
            traceback.clear_frames(e.__traceback__)
            todo += [e.__cause__, e.__context__]


class _Failed(Exception):
    """A call did not reach the server (breaker open or backend failure)."""


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


class RedisStore(SpillStore):
    """Spill tier on Redis. `url`: redis://[user:password@]host:port/db, rediss://... (TLS;
    ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_cert_reqs as query parameters or kwargs),
    unix:///path, or redis+cluster://host:port (rediss+cluster:// with TLS).

    `deadline_ms` bounds each socket operation (connect, send, receive) of a call.
    """

    name = "redis"
    copies_values = True

    def __init__(
        self,
        url: str,
        namespace_id: str,
        ttl_s: int | None = None,
        deadline_ms: float = 200.0,
        breaker: CircuitBreaker | None = None,
        **connection_kwargs: Any,
    ):
        if not url.startswith(SCHEMES):
            raise ValueError(f"redis url must start with one of {SCHEMES}, got {url!r}")
        if not namespace_id or not namespace_id.isprintable() or " " in namespace_id:
            raise ValueError(f"namespace_id must be printable without spaces, got {namespace_id!r}")
        if ttl_s is not None and (not isinstance(ttl_s, int) or ttl_s < 1):
            raise ValueError(f"ttl_s must be an int >= 1 or None, got {ttl_s!r}")
        if deadline_ms <= 0:
            raise ValueError(f"deadline_ms must be > 0, got {deadline_ms!r}")
        self.url, self.ttl_s, self.deadline_ms = url, ttl_s, deadline_ms
        self.cluster = url.startswith(tuple(CLUSTER_SCHEMES))
        self.prefix = f"kvs:{namespace_id}:".encode()
        self.breaker = breaker if breaker is not None else CircuitBreaker(name=self.name)
        timeout = deadline_ms / 1000.0
        self._kwargs = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "health_check_interval": 0,
            **connection_kwargs,
        }
        self._counters = Counters(self.name)
        self._lock = threading.Lock()
        self._client: redis.Redis | RedisCluster | None = None

    # --------------------------------------------------------------- plumbing

    def _connect(self) -> redis.Redis | RedisCluster:
        with self._lock:
            if self._client is None:
                if self.cluster:
                    scheme = next(s for s in CLUSTER_SCHEMES if self.url.startswith(s))
                    url = CLUSTER_SCHEMES[scheme] + self.url[len(scheme) :]
                    self._client = RedisCluster.from_url(url, retry=_no_retry(), **self._kwargs)
                else:
                    self._client = redis.Redis.from_url(self.url, retry=_no_retry(), **self._kwargs)
            return self._client

    def _reset_connections(self) -> None:
        """After a connection failure, start a new client (a fresh pool and cluster topology).

        Other threads may be mid-call on the old client: only its idle connections are closed
        here; the ones in use close with it when it is collected.
        """
        with self._lock:
            client, self._client = self._client, None
        pool = getattr(client, "connection_pool", None)
        if pool is not None:
            with contextlib.suppress(Exception):
                pool.disconnect(inuse_connections=False)

    def _call(self, op: Callable[[redis.Redis | RedisCluster], T]) -> T:
        """Run `op` under the breaker; raises `_Failed` if it did not (or could not) run."""
        if not self.breaker.allow():
            raise _Failed
        try:
            result = op(self._connect())
        except Exception as e:  # any client failure is a miss, never the caller's error
            self.breaker.record_failure(e)
            self._counters.add(errors=1)
            if not isinstance(e, redis.ResponseError) or self.cluster:
                self._reset_connections()  # anything but a server reply may be a bad socket
            # The client's frames hold the error in cycles, and each frame links to its
            # callers': until a gc pass they would keep the callers' arguments alive, such
            # as views of a serving stack's buffer (vLLM then cannot unmap it). Cut them.
            _clear_frames(e)
            raise _Failed from None
        except BaseException:
            self.breaker.record_failure()  # never leave a half-open probe outstanding
            raise
        self.breaker.record_success()
        return result

    def _pipeline(self, commands: Callable[[Any], None]) -> list[Any]:
        def run(client: redis.Redis | RedisCluster) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            commands(pipe)
            results = pipe.execute(raise_on_error=False)
            if any(isinstance(r, _CONNECTION_FAILURES) for r in results):
                raise next(r for r in results if isinstance(r, _CONNECTION_FAILURES))
            return results

        return self._call(run)

    def _rkey(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    # --------------------------------------------------------------- reads

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        found = self.contains_many(keys)
        return next((i for i, present in enumerate(found) if not present), len(found))

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        try:
            found = self._pipeline(lambda pipe: [pipe.exists(self._rkey(k)) for k in keys])
        except _Failed:
            return [False] * len(keys)
        return [n == 1 for n in found]

    def _fetch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        values: list[bytes | None] = [None] * len(keys)
        if keys:
            rkeys = [self._rkey(k) for k in keys]
            try:
                if self.cluster:  # GETs pipelined per node: one MGET across slots is CROSSSLOT
                    got = self._pipeline(lambda pipe: [pipe.get(k) for k in rkeys])
                else:
                    got = self._call(lambda client: client.mget(rkeys))
                values = [v if isinstance(v, bytes) else None for v in got]
            except _Failed:
                pass
        return values

    # --------------------------------------------------------------- writes

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        if not items:
            return 0

        def commands(pipe: Any) -> None:
            for key, value in items:
                pipe.set(self._rkey(key), value, nx=True, ex=self.ttl_s)

        try:
            results = self._pipeline(commands)
        except _Failed:
            self._counters.add(dropped_writes=len(items))
            return 0
        written = sum(r is True for r in results)
        failed = sum(isinstance(r, Exception) for r in results)  # e.g. OOM under maxmemory
        self._counters.add(writes=written, dropped_writes=failed, errors=min(failed, 1))
        changes = Changes()  # NX: a key already there (None) is held too
        changes.stored(key for (key, _), r in zip(items, results, strict=True) if _stored(r))
        self._changed(changes)
        return written

    def retain(self, keys: Sequence[bytes], ttl_s: float) -> int:
        """PEXPIRE ... GT: an entry's TTL only grows, and one without a TTL keeps none (under
        `maxmemory-policy volatile-ttl` Redis evicts the entries expiring soonest first)."""
        if not keys:
            return 0
        ms = max(1, int(ttl_s * 1000))

        def commands(pipe: Any) -> None:
            for key in keys:
                pipe.pexpire(self._rkey(key), ms, gt=True)
                pipe.pttl(self._rkey(key))  # -2: absent

        try:
            results = self._pipeline(commands)
        except _Failed:
            return 0
        if any(isinstance(r, Exception) for r in results):  # e.g. an ACL without PEXPIRE
            self._counters.add(errors=1)
        pairs = zip(results[::2], results[1::2], strict=True)  # (PEXPIRE, PTTL) of each key
        return sum(isinstance(e, int) and isinstance(t, int) and t != -2 for e, t in pairs)

    def delete(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        try:
            results = self._pipeline(lambda pipe: [pipe.delete(self._rkey(k)) for k in keys])
        except _Failed:
            return 0
        changes = Changes()
        changes.removed(k for k, r in zip(keys, results, strict=True) if r == 1)
        self._changed(changes)
        return sum(r for r in results if isinstance(r, int))

    # --------------------------------------------------------------- admin

    def identity(self) -> str | None:
        return url_identity(self.url)

    def probe(self) -> str | None:
        """None when the server answers a PING now, else why not (one line). Outside the
        breaker and the counters: a check, not a call of the cache."""
        try:
            self._connect().ping()
        except _FAILURES as e:
            self._reset_connections()
            return f"{redact_url(self.url)}: {describe(e)}"
        return None

    def stats(self) -> StoreStats:
        return self._stats(None, None, None, breaker_state=self.breaker.state)

    def count_entries(self) -> int | None:
        """This namespace's key count by SCAN (an admin call: it walks the keyspace)."""
        pattern = _glob_escape(self.prefix) + b"*"
        try:
            return self._call(lambda c: sum(1 for _ in c.scan_iter(match=pattern, count=1000)))
        except _Failed:
            return None

    def clear(self) -> int:
        """Delete this namespace's keys (SCAN + UNLINK, every node of a cluster)."""
        pattern = _glob_escape(self.prefix) + b"*"

        def scan_and_unlink(client: redis.Redis | RedisCluster) -> int:
            removed = 0
            batch: list[bytes] = []
            for key in client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) == 1000:
                    removed += _unlink(client, batch)
                    batch = []
            return removed + (_unlink(client, batch) if batch else 0)

        try:
            return self._call(scan_and_unlink)
        except _Failed:
            return 0

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*_FAILURES):
                client.close()


def _stored(result: object) -> bool:
    """A SET NX answered: True (written) or None (there already); not an error."""
    return result is True or result is None


def url_identity(url: str) -> str:
    """`url` without its user and password: scheme, host, port and database."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url


def redact_url(url: str) -> str:
    """`url` with its password (if any) replaced by `***`: fit for logs."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.partition(':')[0]}:***@{host}"


def _glob_escape(raw: bytes) -> bytes:
    return b"".join(b"\\" + bytes([c]) if chr(c) in _GLOB_CHARS else bytes([c]) for c in raw)


def _unlink(client: redis.Redis | RedisCluster, keys: list[bytes]) -> int:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.unlink(key)
    return sum(r for r in pipe.execute(raise_on_error=False) if isinstance(r, int))
