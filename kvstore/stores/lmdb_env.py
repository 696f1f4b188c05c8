"""The process-wide registry of open LMDB environments behind `LmdbStore`.

LMDB forbids opening one path twice in a process, so stores on the same directory share one
`_SharedEnv` (reference counted). A forked child must not use its parent's handle: the
registry moves the parent's environments aside at fork and reopens them lazily.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import lmdb

from kvstore.config import ConfigError

DB_NAMES = (b"blocks", b"order", b"seq", b"meta", b"expiry")


@dataclass
class SharedEnv:
    """One process's handle on an environment; LMDB forbids opening a path twice per process."""

    env: lmdb.Environment
    blocks: lmdb._Database
    order: lmdb._Database
    seq: lmdb._Database
    meta: lmdb._Database
    expiry: lmdb._Database
    main: lmdb._Database
    pid: int
    refs: int = 1

    @property
    def all_dbs(self) -> tuple[lmdb._Database, ...]:
        return (self.main, self.blocks, self.order, self.seq, self.meta, self.expiry)


_registry_lock = threading.Lock()
_open_envs: dict[str, SharedEnv] = {}
_inherited: dict[str, lmdb.Environment] = {}  # opened by the parent before a fork


def _after_fork_in_child() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()
    _inherited.update((path, shared.env) for path, shared in _open_envs.items())
    _open_envs.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def prepare_dir(path: str) -> None:
    """Create the environment's directory; `ConfigError` (field lmdb_dir) saying why not."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        why = f"{path} exists and is not a directory; give a directory"
        raise ConfigError("lmdb_dir", why) from None
    except OSError as e:
        why = f"cannot create {path} ({e.strerror}); give a writable directory"
        raise ConfigError("lmdb_dir", why) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError("lmdb_dir", f"{path} is not writable; give a writable directory")


def _open_env(path: str, map_size_bytes: int) -> SharedEnv:
    prepare_dir(path)
    try:
        env = lmdb.open(
            path,
            map_size=map_size_bytes,
            subdir=True,
            max_dbs=len(DB_NAMES),
            sync=False,
            metasync=False,
            readahead=False,
            lock=True,
        )
    except lmdb.Error as e:
        raise ConfigError("lmdb_dir", f"cannot open an LMDB environment in {path}: {e}") from None
    env.reader_check()  # clear reader slots left by dead processes
    blocks, order, seq, meta, expiry = (env.open_db(name) for name in DB_NAMES)
    return SharedEnv(env, blocks, order, seq, meta, expiry, env.open_db(), os.getpid())


def acquire(path: str, map_size_bytes: int) -> SharedEnv:
    with _registry_lock:
        shared = _open_envs.get(path)
        if shared is not None:
            shared.refs += 1
            return shared
        inherited = _inherited.pop(path, None)
        if inherited is not None:
            # The binding refuses a second open of the same files until the inherited handle
            # is closed. Closing it also frees the parent's reader slots; a parent read racing
            # with this can then see recycled pages, which entry checksums turn into a miss.
            inherited.close()
        shared = _open_envs[path] = _open_env(path, map_size_bytes)
        return shared


def release(path: str, shared: SharedEnv) -> None:
    with _registry_lock:
        if shared.pid != os.getpid() or _open_envs.get(path) is not shared:
            return
        shared.refs -= 1
        if shared.refs == 0:
            del _open_envs[path]
            shared.env.close()
