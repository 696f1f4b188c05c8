"""ThrottledProxy: a loopback TCP proxy that paces the bytes each way to a set rate, so a slow
tier (Redis across a thin link) can be shown on any machine: `bench ttft --throttle-mbps`
and the read gate's tests put one in front of a real redis-server.

Each direction has one token bucket shared by every connection (the link's rate, not each
connection's); bytes pass in pieces of at most `PIECE`, each waiting for its tokens."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

PIECE = 16 << 10  # bytes sent at once: the pacing's grain


class Bucket:
    """Bytes per second, with a burst of one piece (thread-safe)."""

    def __init__(self, bytes_per_s: float):
        self.rate, self._lock = bytes_per_s, threading.Lock()
        self._next = time.monotonic()  # when the link is free again

    def take(self, num_bytes: int) -> None:
        """Wait until `num_bytes` may pass."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)  # the link is busy with earlier pieces until then
            self._next = start + num_bytes / self.rate
        if start > now:
            time.sleep(start - now)


class ThrottledProxy:
    """Listens on 127.0.0.1 (a free port) and forwards each connection to `target`, at most
    `bytes_per_s` each way."""

    def __init__(self, target_host: str, target_port: int, bytes_per_s: float):
        if bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s!r}")
        self.target = (target_host, target_port)
        self.buckets = (Bucket(bytes_per_s), Bucket(bytes_per_s))  # to the target, back
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def __enter__(self) -> ThrottledProxy:
        threading.Thread(target=self._accept, daemon=True, name="throttle-accept").start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def url(self, scheme: str = "redis", path: str = "/0") -> str:
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst, bucket in ((client, upstream, self.buckets[0]),
                                     (upstream, client, self.buckets[1])):  # fmt: skip
                threading.Thread(target=_pump, args=(src, dst, bucket), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket, bucket: Bucket) -> None:
    """Copy src to dst at the bucket's pace until either side closes."""
    try:
        while data := src.recv(PIECE):
            bucket.take(len(data))
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
