"""Sampled tokens that stay on the device: the next step launches before this step's tokens
reach the host, as mini-sglang's overlap loop and vLLM's async scheduling run.

A step whose sampling rows are all plain greedy (no logprobs, no `best_of` ranking, no
group to release, no prompt logprobs gathered) takes its tokens with one argmax on the
device into `DeviceTokens.sampled`, starts their copy to pinned host memory and records an
event, and returns. Each of its requests then holds one *pending* token: counted in its
length (`Request.num_pending`), fed to its next decode row from the device
(`Feed`: a graph replay gathers it inside the graph, engine/attention/decode_buffers.py),
and delivered one step late: the next step is enqueued first, then the host waits for the
event (by then long done on a GPU: only the next step runs) and each token is emitted, stop
rules checked and finished requests resolved exactly as a synchronous step would
(`Outcomes.deliver`). A request that stops on that token was given one more decode row in
the step already enqueued; that row's token is dropped, and its K/V lands past what the
request keeps (a finished request's K/V covers every token but its last, as always).

Anything else a step samples, it samples on the host as before, after delivering the
pending tokens. The engine's synchronous paths, an idle loop and `close` deliver them too.
On a CPU nothing runs ahead of the host, so the engine keeps the synchronous order there
unless asked (`SchedulerConfig.async_scheduling`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from engine.loop.group import unreleased_leader
from engine.loop.request import Request

log = logging.getLogger("kvstore.engine")


class Feed(NamedTuple):
    """A step's tokens that are still on the device: row `rows[i]`'s last fed token is
    `sampled[slots[i]]`."""

    rows: list[int]
    slots: list[int]
    sampled: torch.Tensor  # [max rows] long: the previous step's sampled tokens


class DeviceTokens:
    """The last asynchronous step's sampled tokens, on the device and on their way to the
    host."""

    def __init__(self, max_rows: int, device: torch.device):
        cuda = device.type == "cuda"
        self.sampled = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.host = torch.zeros(max_rows, dtype=torch.long, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.count = 0  # tokens of the step in flight

    def launch(self, logits: torch.Tensor) -> None:
        """Greedy tokens of `logits` [n, vocab] into `sampled[:n]`, copied to the host
        without waiting."""
        n = logits.shape[0]
        torch.argmax(logits, dim=-1, out=self.sampled[:n])
        self.host[:n].copy_(self.sampled[:n], non_blocking=True)
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self.sampled.device))
        self.count = n

    def read(self) -> list[int]:
        """The tokens of the step in flight, once they are on the host."""
        if self.event is not None:
            self.event.synchronize()
        return self.host[: self.count].tolist()


def runs_ahead(requests: Sequence[Request], gathers_prompt_logprobs: bool) -> bool:
    """Whether a step sampling `requests` can take its tokens on the device."""
    if gathers_prompt_logprobs:
        return False
    return all(
        r.params.temperature == 0
        and r.params.logprobs is None
        and r.cumulative_logprob is None
        and unreleased_leader(r) is None
        for r in requests
    )


class Overlap:
    """The step whose tokens are still on their way, and their delivery."""

    def __init__(
        self,
        tokens: DeviceTokens,
        deliver: Callable[[Request, int], None],
        fail: Callable[[Request, BaseException], None],
    ):
        self.tokens = tokens
        self.deliver = deliver  # emit, stop rules, finish: `Outcomes.deliver`
        self.fail = fail  # `Outcomes.fail`: a request whose delivery raised ends with it
        self.requests: list[Request] = []  # the requests whose tokens are in flight

    def launch(self, requests: list[Request], logits: torch.Tensor) -> None:
        """Sample the step's rows on the device; each request now has a pending token."""
        self.tokens.launch(logits)
        for slot, request in enumerate(requests):
            request.num_pending, request.pending_slot = 1, slot
        self.requests = requests

    def feed(self, requests: Sequence[Request]) -> Feed | None:
        """Where a step's rows (`requests`, in order) find their pending tokens."""
        rows = [i for i, r in enumerate(requests) if r.num_pending]
        if not rows:
            return None
        slots = [requests[i].pending_slot for i in rows]
        return Feed(rows, slots, self.tokens.sampled)  # type: ignore[arg-type]

    def drain(self) -> bool:
        """Deliver the pending tokens (False: there were none). A request that ended
        meanwhile (failed, cancelled) drops its token; one whose delivery raises fails,
        and the others are still delivered."""
        if not self.requests:
            return False
        requests, self.requests = self.requests, []
        tokens = self.tokens.read()
        for request in requests:  # first: nothing is left pending whatever a delivery does
            request.num_pending, request.pending_slot = 0, None
        for request, token in zip(requests, tokens, strict=True):
            if request.future.done():
                continue
            try:
                self.deliver(request, token)
            except Exception as e:
                log.exception("delivering a token failed")
                self.fail(request, e)
        return True
