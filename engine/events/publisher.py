"""A replica's KV events on ZMQ, in vLLM's format (engine/events/wire.py), and their
consumer (engine/events/subscriber.py).

`ZmqEventPublisher` is the cache's `EventSink`: `emit` only queues; a background thread
sends the queued events as one batch per flush interval, numbered from 0, keeps the last
`buffer_batches` for replay and answers replay requests. Its first batch is
`[AllBlocksCleared()]` (consumers drop what a previous run of the replica told them), and an
empty batch goes out after `heartbeat_s` without one (a consumer can tell a quiet replica
from a dead or partitioned one).

A replay that asks for batches older than the buffer holds is answered, when the publisher
has a `snapshot` (the cache's `snapshot_events`), by one batch `[AllBlocksCleared(),
*snapshot()]` numbered with the last published seq. Events are idempotent set operations
(kvstore/fleet/events.py), so that batch followed by every later one gives the index's blocks,
even though events queued before the snapshot was taken are sent after it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

import zmq

from engine.events.subscriber import DEFAULT_TOPIC, EventSubscriber
from engine.events.wire import (
    END_SEQ,
    MEDIUM_CPU,
    MEDIUM_GPU,
    decode_batch,
    encode_batch,
    ipv6_socket,
    medium_for,
    seq_bytes,
)
from kvstore.config import ConfigError
from kvstore.fleet.events import AllBlocksCleared, BlockStored, EventSink, KVEvent

__all__ = [
    "EventSubscriber",
    "EventsConfig",
    "ZmqEventPublisher",
    "decode_batch",
    "encode_batch",
    "medium_for",
]

log = logging.getLogger("kvstore.fleet.events")
PUB_HWM = 100_000  # batches ZMQ queues per subscriber before it drops (vLLM's default)
REPLAY_REQUESTS_PER_TURN = 16
POLL_MS = 50  # longest wait between two looks at the stop flag
CLOSE_TIMEOUT_S = 2.0
SCHEMES = ("tcp://", "ipc://", "inproc://")

Snapshot = Callable[[], list[BlockStored]]


@dataclass(frozen=True)
class EventsConfig:
    """Where and how a replica publishes its index's events. Both endpoints are bound
    (`tcp://*:5557`; port `*` picks a free one, `ZmqEventPublisher.endpoint` says which)."""

    endpoint: str = "tcp://*:5557"  # PUB
    replay_endpoint: str | None = None  # ROUTER answering replay requests; None: no replay
    topic: str = DEFAULT_TOPIC
    buffer_batches: int = 10_000  # batches kept for replay
    flush_interval_ms: float = 10.0  # queued events go out as one batch this often
    heartbeat_s: float = 1.0  # an empty batch after this long without a batch
    medium: str = MEDIUM_CPU  # vLLM's medium: "GPU" for a CUDA pool (`medium_for`)
    max_queue_events: int = 100_000  # queued past this: consumers are resynced

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(SCHEMES):
                raise ConfigError(name, f"expected tcp://HOST:PORT (or ipc://), got {value!r}")
        if self.replay_endpoint == self.endpoint and not self.endpoint.endswith((":*", ":0")):
            raise ConfigError("replay_endpoint", "must differ from endpoint")
        if not isinstance(self.topic, str):
            raise ConfigError("topic", f"must be a string, got {self.topic!r}")
        for name in ("buffer_batches", "max_queue_events"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be an int >= 1, got {value!r}")
        for name in ("flush_interval_ms", "heartbeat_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(name, f"must be a number > 0, got {value!r}")
        if self.medium not in (MEDIUM_CPU, MEDIUM_GPU):
            message = f"must be {MEDIUM_CPU} or {MEDIUM_GPU}, got {self.medium!r}"
            raise ConfigError("medium", message)


class ZmqEventPublisher(EventSink):
    """Publishes a cache's events (pass it as `PrefixCache(..., events=publisher)`)."""

    def __init__(self, config: EventsConfig, snapshot: Snapshot | None = None):
        """Binds the sockets (OSError when an endpoint cannot be bound) and starts the
        thread. `snapshot`: the index as stored events, for replays the buffer cannot serve."""
        self.config = config
        self._snapshot = snapshot
        self._queue: deque[KVEvent] = deque()
        self._overflow = False
        self._stop = threading.Event()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_batches)
        self._topic = config.topic.encode()
        self._last_sent = 0.0
        self.last_seq = -1  # the last published batch
        self.replays = self.snapshots = self.dropped_events = 0
        self.published_events = 0  # the cache's events sent so far
        self._ctx = zmq.Context()
        try:
            self._pub = self._bind(zmq.PUB, config.endpoint, PUB_HWM)
            self._replay = None
            if config.replay_endpoint is not None:
                hwm = 2 * (config.buffer_batches + 1)  # a whole replay and its end marker
                self._replay = self._bind(zmq.ROUTER, config.replay_endpoint, hwm)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise OSError(f"KV events: cannot bind {e}") from None
        self.endpoint = self._bound(self._pub)
        self.replay_endpoint = self._bound(self._replay) if self._replay else None
        self._thread = threading.Thread(target=self._run, name="kv-events-pub", daemon=True)
        self._thread.start()

    def _bind(self, kind: int, endpoint: str, hwm: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        ipv6_socket(sock, endpoint)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise zmq.ZMQError(e.errno, f"{endpoint}: {e.strerror}") from None
        return sock

    @staticmethod
    def _bound(sock: zmq.Socket) -> str:
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # --- the cache's side (under its lock: quick) ---------------------------------------

    def emit(self, event: KVEvent) -> None:
        if self._stop.is_set():
            return
        if len(self._queue) >= self.config.max_queue_events:
            self._overflow = True  # the next flush resyncs consumers
            return
        self._queue.append(event)

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._publish([AllBlocksCleared()])
            while not self._stop.is_set():
                self._turn()
            self._flush()
        except Exception:
            log.exception("KV events: the publisher stopped")
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._ctx.term()

    def _turn(self) -> None:
        """Wait up to one flush interval answering replay requests, then flush."""
        try:
            self._serve(self.config.flush_interval_ms)
            self._flush()
        except Exception:  # a failed send or snapshot: logged, and the thread goes on
            if not self._stop.is_set():
                log.exception("KV events: publishing failed")
                self._stop.wait(0.1)

    def _serve(self, timeout_ms: float) -> None:
        deadline = time.monotonic() + timeout_ms / 1000
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._replay is None:
                self._stop.wait(left)
            elif self._replay.poll(max(1, min(POLL_MS, round(left * 1000)))):
                for _ in range(REPLAY_REQUESTS_PER_TURN):
                    self._answer(self._replay.recv_multipart())
                    if not self._replay.poll(0):
                        break

    def _answer(self, frames: list[bytes]) -> None:
        """(client, b"", start seq): every buffered batch from start, then the end marker."""
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: ignored a malformed replay request (%d frames)", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        self.replays += 1
        oldest = self._buffer[0][0]
        if start < oldest and self._snapshot is not None:
            self.snapshots += 1
            batches = [(self.last_seq, self._encode([AllBlocksCleared(), *self._snapshot()]))]
        else:
            batches = list(islice(self._buffer, max(0, start - oldest), None))
        for seq, payload in batches:
            self._replay.send_multipart((client, b"", self._topic, seq_bytes(seq), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _flush(self) -> None:
        events, taken = self._take()
        if events or time.monotonic() - self._last_sent >= self.config.heartbeat_s:
            self._publish(events)
        self.published_events += taken

    def _take(self) -> tuple[list[KVEvent], int]:
        """The events to send now, and how many of them came from the queue."""
        if self._overflow:
            return self._resync(), 0
        n = len(self._queue)
        return [self._queue.popleft() for _ in range(n)], n

    def _resync(self) -> list[KVEvent]:
        """After events were dropped: every consumer drops its blocks and reads the snapshot
        (without one, consumers under-count until the blocks are stored again)."""
        self._overflow = False
        self.dropped_events += len(self._queue)
        self._queue.clear()  # before the snapshot, which then covers what was queued
        log.warning("KV events: over %d events queued; consumers are resynced",
                    self.config.max_queue_events)  # fmt: skip
        try:
            return [AllBlocksCleared(), *(self._snapshot() if self._snapshot else [])]
        except BaseException:
            self._overflow = True  # the next flush tries again
            raise

    def _publish(self, events: list[KVEvent]) -> None:
        seq, payload = self.last_seq + 1, self._encode(events)
        self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
        self._buffer.append((seq, payload))
        self.last_seq, self._last_sent = seq, time.monotonic()

    def _encode(self, events: list[KVEvent]) -> bytes:
        return encode_batch(time.time(), events, self.config.medium)

    # --- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Publish what is queued, stop the thread, close the sockets (linger 0: delivery of
        that last batch is best effort). Idempotent; never waits more than a few seconds."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("KV events: the publisher thread did not stop in %.0f s", CLOSE_TIMEOUT_S)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
