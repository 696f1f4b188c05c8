"""The glibc heap of `kvstore serve`: capped malloc arenas, and trimmed once the server goes
quiet. Both are no-ops where the C library is not glibc.

Why the trim: the soak (docs/RELIABILITY.md) found the heap in use flat under load (+3.4 MB
over 6 minutes of 16 streaming clients, 1.5 MB of it Python objects), while free memory that
glibc kept inside its arenas rose from 6 to 43 MB: per-step tensors of varying sizes leave
holes between live chunks, which glibc only returns on `malloc_trim`. Trimming while requests
run would cost them time; trimming after a quiet spell costs nothing and gives it back."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import time
from collections.abc import Callable
from contextlib import suppress

MALLOC_ARENAS = 2
M_ARENA_MAX = -8  # glibc's mallopt parameter
QUIET_S = 2.0  # no request in flight for this long: the server is quiet
TICK_S = 0.5
log = logging.getLogger("kvstore.server")


def _libc() -> ctypes.CDLL | None:
    with suppress(OSError):
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    return None


def cap_malloc_arenas() -> None:
    """Cap glibc's malloc arenas (unless MALLOC_ARENA_MAX is set). glibc gives threads that
    allocate arenas of their own, up to 8 per core, and memory freed in one stays there: under
    16 streaming clients the request threads grew the server's heap by 20-35% within two
    minutes, still wandering; with 2 arenas it levelled off after the first minute."""
    libc = _libc()
    if "MALLOC_ARENA_MAX" in os.environ or libc is None:
        return
    if libc.mallopt(M_ARENA_MAX, MALLOC_ARENAS) == 0:
        log.debug("mallopt(M_ARENA_MAX) failed: malloc arenas are not capped")


def trim_heap() -> bool:
    """Give the free pages inside glibc's arenas back to the system; False if none were."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


class QuietTrimmer:
    """Trims the heap once per quiet spell that follows some requests. `activity` counts
    requests that arrived so far, `in_flight` those not answered yet."""

    def __init__(
        self,
        activity: Callable[[], int],
        in_flight: Callable[[], int],
        quiet_s: float = QUIET_S,
        tick_s: float = TICK_S,
    ):
        self.activity, self.in_flight = activity, in_flight
        self.quiet_s, self.tick_s = quiet_s, tick_s
        self.trims = 0
        self._trimmed_at = activity()  # requests seen at the last trim (or at the start)
        self._quiet_since: float | None = None

    def due(self, now: float) -> bool:
        """One tick at `now` (seconds): whether the heap is to be trimmed now, the first tick
        of a quiet spell `quiet_s` long that follows requests not trimmed after yet."""
        if self.in_flight():
            self._quiet_since = None
            return False
        if self._quiet_since is None:
            self._quiet_since = now
        seen = self.activity()
        if seen == self._trimmed_at or now - self._quiet_since < self.quiet_s:
            return False
        self._trimmed_at = seen
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            if self.due(time.monotonic()):
                released = await asyncio.to_thread(trim_heap)
                self.trims += 1
                log.debug("quiet: heap trimmed (%s)", "pages returned" if released else "none")
