"""EventSubscriber: a consumer's view of one replica's index, kept from the replica's KV
events (published by engine/events/publisher.py, or by vLLM: the format is vLLM's).

Sync: the subscriber starts unsynced and asks the replay socket for every batch from seq 0;
it applies them in order and then the PUB stream from the next seq on, skipping the batches
a replay already brought. A seq that jumps ahead is a gap: the subscriber is unsynced until
a replay repairs it. That replay starts at the last batch applied, a witness: a publisher
that no longer has it, or has another payload under its seq, was restarted. A restart (also
seen as a seq going backwards on the PUB stream) drops every block, then resyncs from 0.
A dropped PUB connection (the replica stopped, or went away) also unsyncs: once it is back,
the replay's witness tells a reconnect from a restart. While unsynced, `stale()` is True,
and a failed replay (the replica is not up, or away) is retried; ZMQ reconnects both sockets
by itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from engine.events.wire import decode_batch, ipv6_socket, seq_bytes, seq_of
from kvstore.fleet.events import AllBlocksCleared, BlockSet, KVEvent, MediaBlocks

log = logging.getLogger("kvstore.fleet.events")
DEFAULT_TOPIC = "kv@kvstore"
POLL_MS = 50
RECV_PER_TURN = 256
DIGESTS_KEPT = 1024  # seqs whose payload digests are kept (to tell a replay from a restart)
CLOSE_TIMEOUT_S = 2.0
HEARTBEAT_MS = 1000  # ZMTP pings on the PUB connection


class EventSubscriber:
    """Blocks of one replica, from its events; `start()` runs it in a background thread."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = DEFAULT_TOPIC,
        replay_timeout_s: float = 1.0,
        retry_s: float = 0.5,
        shared: Mapping[str, BlockSet] | None = None,
    ):
        """`endpoint`: the replica's PUB socket; `replay_endpoint`: its replay socket (without
        one, events sent before the subscriber connected, or lost, are not repaired);
        `shared`: the set of each spill medium it shares with other replicas (a shared
        Redis), which its events update and its restarts leave alone."""
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.replay_timeout_s, self.retry_s = replay_timeout_s, retry_s
        self._shared = dict(shared or {})
        self.media = self._fresh()  # replaced whole by a replay: read it through the attribute
        self.last_seq = -1  # the last batch applied
        self.last_message_at: float | None = None  # monotonic time of the last batch received
        self.gaps = self.restarts = self.replays = self.bad_batches = 0
        self._synced = replay_endpoint is None
        self._last_pub: int | None = None  # the last seq seen on the PUB stream
        self._digests: dict[int, int] = {}
        self._retry_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> EventSubscriber:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-events-sub", daemon=True)
            self._thread.start()
        return self

    @property
    def blocks(self) -> BlockSet:
        """Its device pool's blocks (`media` has its spill tiers' too)."""
        return self.media.device

    def _fresh(self) -> MediaBlocks:
        return MediaBlocks(BlockSet(), self._shared, self._shared)

    @property
    def synced(self) -> bool:
        return self._synced

    def stale(self, now: float, stale_after_s: float) -> bool:
        """True when `blocks` cannot be trusted at `now` (monotonic): no batch or heartbeat
        within stale_after_s, or a gap not repaired yet."""
        seen = self.last_message_at
        return not self._synced or seen is None or now - seen > stale_after_s

    def close(self) -> None:
        """Stop the thread (within about POLL_MS) and close the sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CLOSE_TIMEOUT_S)

    def __enter__(self) -> EventSubscriber:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)  # finds a peer that vanished
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * HEARTBEAT_MS)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        dealer: zmq.Socket | None = None
        try:
            ipv6_socket(sub, self.endpoint)
            sub.connect(self.endpoint)  # a bad endpoint is logged below, and stays stale
            while not self._stop.is_set():
                if not self._synced and time.monotonic() >= self._retry_at:
                    dealer = dealer or self._dealer(ctx)
                    if not self._replay(dealer):  # a late or lost answer must not be read
                        dealer.close(linger=0)
                        dealer, self._retry_at = None, time.monotonic() + self.retry_s
                ready = dict(poller.poll(POLL_MS))
                if monitor in ready:  # first: batches after a reconnect are checked
                    self._on_monitor(monitor)
                if sub in ready:
                    self._receive(sub)
        except Exception:
            log.exception("KV events: the subscriber of %s stopped", self.endpoint)
        finally:
            sub.disable_monitor()
            for sock in (monitor, sub, dealer):
                if sock is not None:
                    sock.close(linger=0)
            ctx.term()

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        while monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._disconnected()

    def _disconnected(self) -> None:
        """The PUB connection dropped: the replica may come back as a new run. Unsynced
        until a replay from the last batch applied says which."""
        if self.replay_endpoint is not None:
            self._synced = False

    def _dealer(self, ctx: zmq.Context) -> zmq.Socket:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        ipv6_socket(dealer, self.replay_endpoint)
        dealer.connect(self.replay_endpoint)
        return dealer

    def _receive(self, sub: zmq.Socket) -> None:
        topic = self.topic.encode()
        for _ in range(RECV_PER_TURN):
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) == 3 and frames[0] == topic and len(frames[1]) == 8:
                self._on_pub(seq_of(frames[1]), frames[2])

    def _on_pub(self, seq: int, payload: bytes) -> None:
        self.last_message_at = time.monotonic()
        if self._restarted(seq, payload):
            self._restart()
            if self.replay_endpoint is None:  # no way to learn what came before: go on
                self._apply(self.media, seq, payload)
        self._last_pub = seq
        if not self._synced:
            self._retry_at = 0.0  # the replica is up: replay now
            return
        if seq <= self.last_seq:
            return  # a replay brought it
        if seq != self.last_seq + 1 and self.last_seq >= 0:
            self.gaps += 1
            if self.replay_endpoint is not None:
                self._synced = False
                return
            log.warning("KV events: batches %d..%d of %s are lost", self.last_seq + 1, seq - 1,
                        self.endpoint)  # fmt: skip
        self._apply(self.media, seq, payload)

    def _restarted(self, seq: int, payload: bytes) -> bool:
        """A PUB stream goes up one by one; a seq we applied comes again with its payload."""
        if self._last_pub is not None and seq <= self._last_pub:
            return True
        known = self._digests.get(seq)
        return known is not None and known != hash(payload)

    def _restart(self) -> None:
        self.restarts += 1
        log.info("KV events: %s restarted; its blocks are dropped", self.endpoint)
        self._synced = False  # first: a reader never sees the empty set as synced
        self.media, self.last_seq, self._last_pub = self._fresh(), -1, None
        self._digests.clear()
        self._synced = self.replay_endpoint is None

    # --- replay ----------------------------------------------------------------------------

    def _replay(self, dealer: zmq.Socket) -> bool:
        """Ask for every batch from the last one applied (from 0 at first); False when no
        whole answer came within replay_timeout_s (or when closing)."""
        ask = max(self.last_seq, 0)
        try:
            dealer.send_multipart((b"", seq_bytes(ask)), zmq.NOBLOCK)
        except zmq.Again:
            return False
        batches: list[tuple[int, bytes]] = []
        while True:
            if not self._wait(dealer):
                return False
            frames = dealer.recv_multipart()
            if len(frames) < 3:
                continue
            seq = seq_of(frames[-2])
            if seq < 0:
                break
            batches.append((seq, frames[-1]))
        self.replays += 1
        self.last_message_at = time.monotonic()
        self._apply_replay(ask, batches)
        return True

    def _wait(self, sock: zmq.Socket) -> bool:
        deadline = time.monotonic() + self.replay_timeout_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            if sock.poll(POLL_MS):
                return True
        return False

    def _apply_replay(self, ask: int, batches: list[tuple[int, bytes]]) -> None:
        if self.last_seq >= 0:
            if not self._same_run(ask, batches):
                self._restart()  # not the run we followed: the next turn replays from 0
                return
            if batches[0][0] == ask:
                batches = batches[1:]  # the witness, applied already
        first_missing = self.last_seq + 1
        fresh = bool(batches) and batches[0][0] > first_missing  # a snapshot, or a loss
        blocks = self._fresh() if fresh else self.media.copy()
        for i, (seq, payload) in enumerate(batches):
            events = self._apply(blocks, seq, payload, remember=not (fresh and i == 0))
            if fresh and i == 0 and not _clears(events):
                log.warning("KV events: %s no longer holds batches %d..%d (and has no "
                            "snapshot): its blocks are under-counted", self.endpoint,
                            first_missing, seq - 1)  # fmt: skip
        self.media, self._synced = blocks, True

    def _same_run(self, ask: int, batches: list[tuple[int, bytes]]) -> bool:
        """The publisher still has the batch we applied last (`ask`), with its payload; or
        has moved past it (its answer then starts afresh)."""
        if not batches:
            return False
        seq, payload = batches[0]
        return seq > ask or self._digests.get(ask, hash(payload)) == hash(payload)

    # --- applying --------------------------------------------------------------------------

    def _apply(
        self, blocks: MediaBlocks, seq: int, payload: bytes, remember: bool = True
    ) -> list[KVEvent]:
        try:
            _, events = decode_batch(payload)
        except msgspec.DecodeError as e:
            self.bad_batches += 1
            log.warning("KV events: batch %d of %s cannot be decoded: %s", seq, self.endpoint, e)
            events = []
        blocks.apply_all(events)
        self.last_seq = seq
        if remember:
            self._remember(seq, payload)
        return events

    def _remember(self, seq: int, payload: bytes) -> None:
        self._digests[seq] = hash(payload)
        if len(self._digests) > 2 * DIGESTS_KEPT:
            self._digests = {s: d for s, d in self._digests.items() if s > seq - DIGESTS_KEPT}


def _clears(events: list[KVEvent]) -> bool:
    return bool(events) and isinstance(events[0], AllBlocksCleared)
