"""Parallel sampling: the n sequences of one prompt (OpenAI's `n`, and `best_of` on
completions), a `SequenceGroup` that the scheduler admits as one unit.

The prompt is prefilled once. The group's leader (branch 0) is queued like any request, and
its admission asks room for the whole group: its own prompt and first decode slot, and the
blocks each other branch starts with. Once the leader's last prompt chunk is computed (its
full blocks committed to the index), the group is released: every other branch samples its
first token from the leader's logits of the last prompt position (its own sampler: branch i
samples with seed + i; one that asks prompt logprobs takes a copy of the leader's), the
leader lends its partly filled last block (`BlockTables.lend_tail`: one more reference, no
copy), and the scheduler admits the other branches at the next step, together, before any
waiting request, all or none. Each branch's lookup hits the prompt's full blocks by
reference and copies the lent block into a block of its own; it then feeds its first token
beside the leader's second, and decodes on its own, as an independent request with its
seed would.

A leader that ends before its group is released (cancelled, displaced, failed) ends its
branches with the same error: a group never answers in part.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from engine.loop.logprobs import share_prompt
from engine.loop.request import InvalidRequestError, Request, Sampler, SamplingParams
from kvstore.block_tables import BlockTables, LentTail

SEED_RANGE = 2**64  # torch.Generator.manual_seed takes [-2**63, 2**64)


def branch_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Each branch's sampling: branch i uses seed + i (wrapped into torch's seed range) when
    the request is seeded, a random seed of its own otherwise."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=_wrap(params.seed + i)) for i in range(n)]


def _wrap(seed: int) -> int:
    return seed - SEED_RANGE if seed >= SEED_RANGE else seed


class RankedSampler(Sampler):
    """A request's sampler that also adds each token's log-probability to the request's
    `cumulative_logprob` (best_of's ranking), for the per-request path, which samples on
    its own (the engine's steps add it up in `Outcomes.sample`)."""

    def __init__(self, request: Request):
        super().__init__(request.params)
        self.request = request

    def __call__(self, logits: torch.Tensor) -> int:
        token = super().__call__(logits)
        logprob = float(torch.log_softmax(logits.float(), -1)[token])
        self.request.cumulative_logprob = (self.request.cumulative_logprob or 0.0) + logprob
        return token


def sampler_of(request: Request) -> Sampler | None:
    """The sampler the per-request path gives `request` (None: a fresh one)."""
    return request.sampler if request.cumulative_logprob is None else RankedSampler(request)


@dataclass(eq=False)
class SequenceGroup:
    """The sequences of one prompt: requests[i] is branch i, requests[0] the leader."""

    requests: list[Request]
    released: bool = False  # the leader's prompt is computed: the others may be admitted
    waiting: list[Request] = field(default_factory=list)  # branches not admitted yet
    lent: LentTail | None = None  # the leader's partly filled prompt block, while lent

    def __post_init__(self) -> None:
        if not self.requests:
            raise InvalidRequestError("a group needs at least one sequence", "n")
        leader = self.requests[0]
        for request in self.requests:
            same = (request.token_ids, request.cache_salt, request.tenant)
            if same != (leader.token_ids, leader.cache_salt, leader.tenant):
                raise InvalidRequestError("a group's sequences share one prompt, salt and tenant")
            request.group = self
        self.waiting = list(self.requests[1:])

    @property
    def leader(self) -> Request:
        return self.requests[0]

    def dissolve(self) -> list[Request]:
        """Its requests, to be run one by one (the per-request fallback): no unit to admit."""
        self.released, self.waiting = True, []
        return self.requests

    def start_blocks(self, tables: BlockTables) -> int:
        """Blocks the group needs at once to start: the leader's prompt and first decode
        slot, and each other branch's own (`own_blocks`)."""
        num_prompt = len(self.leader.token_ids)
        others = len(self.requests) - 1
        return tables.blocks_for(num_prompt + 1) + others * self.own_blocks(tables)

    def own_blocks(self, tables: BlockTables) -> int:
        """The blocks another branch starts with, past the prompt's full blocks it shares:
        for its first token and the next decode slot (1, or 2 when the prompt's partial
        block has room for one token only)."""
        num_prompt = len(self.leader.token_ids)
        return tables.blocks_for(num_prompt + 2) - num_prompt // tables.block_size

    def refusal(self, tables: BlockTables, max_num_seqs: int) -> InvalidRequestError | None:
        """Why the group can never run at once on this pool and batch (field `n`), or None."""
        n, num_prompt = len(self.requests), len(self.leader.token_ids)
        if n > max_num_seqs:
            why = f"{n} sequences cannot run at once: at most {max_num_seqs} run together"
            return InvalidRequestError(f"{why} (--max-num-seqs)", "n")
        need, usable = self.start_blocks(tables), tables.pool.num_blocks - 1
        if need > usable:
            return InvalidRequestError(
                f"{n} sequences of a {num_prompt}-token prompt need {need} blocks of KV at "
                f"once (the prompt's, and {self.own_blocks(tables)} of each other sequence's "
                f"own); the device pool holds {usable} (raise --device-blocks / "
                "--device-cache-gb, or ask for fewer)",
                "n",
            )
        return None

    def release(self, tables: BlockTables) -> None:
        """The leader's prompt is computed: the others may go, its partial block lent (their
        first tokens are sampled from the leader's logits: engine/loop/outcomes.py)."""
        self.released = True
        num_prompt = len(self.leader.token_ids)
        self.lent = tables.lend_tail(self.leader.state.blocks, num_prompt)
        for request in self.waiting:  # the prompt's block keys (and logprobs): the leader's
            request.keys = self.leader.keys[: num_prompt // tables.block_size]
            share_prompt(self.leader, request)

    def return_lent(self, tables: BlockTables) -> None:
        """Every branch was admitted (or dropped): the lent block goes back."""
        if self.lent is not None:
            tables.return_lent(self.lent)
            self.lent = None


def unreleased_leader(request: Request) -> SequenceGroup | None:
    """The group of which `request` is the leader, while its prompt is not computed yet."""
    group = request.group
    if group is None or group.released or request is not group.leader:
        return None
    return group


def branch_blocks(request: Request, tables: BlockTables) -> int:
    """Blocks the other branches of a leader's group need once released; 0 for any other
    request."""
    group = unreleased_leader(request)
    if group is None:
        return 0
    return group.start_blocks(tables) - tables.blocks_for(len(request.token_ids) + 1)


def orphans(request: Request) -> list[Request]:
    """The branches of a leader that ends before its group is released: they end with it
    (none for any other request)."""
    group = unreleased_leader(request)
    if group is None:
        return []
    group.released = True
    branches, group.waiting = group.waiting, []
    return branches
