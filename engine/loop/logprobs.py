"""Logprobs of the tokens a request samples and of its prompt's tokens.

Both are of the model's raw distribution: log_softmax of the logits before temperature and
top_p (vLLM's default), so they do not change with the sampling settings. Only a request
whose `SamplingParams` ask (`logprobs`, `prompt_logprobs`) pays for them.

Prompt logprobs and the prefix cache. Token t's logprob comes from the logits at position
t - 1, and a prefix-cache hit skips the positions it covers: their logits are never
computed. So the engine keeps, beside the pool, a summary per full prompt block that a
prompt-logprobs request computed: for each of its positions the logprob and rank of the
block's token given everything before it and the `MAX_LOGPROBS` most likely tokens
(`BlockSummary`), keyed by the block's lookup key (the chained hash, which names the block
and everything before it) and checked against its token ids. `PromptLogprobCache` holds
them in a bounded LRU (`summary_blocks`, engine flag `--prompt-logprob-blocks`), in this
process only: blocks a spill tier brings back have summaries only if this process still
holds them. A request that wants prompt logprobs looks up only the leading blocks whose
summaries it can have (`plan`), takes their logprobs from the summaries (`admitted`),
computes the logits of every position it feeds (`record`), and leaves summaries of the
blocks it completes. The values are those a full forward gives, within the output
contract's tolerance, whatever was cached. The table is touched by the engine's loop thread
only (admission and steps), so it takes no lock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from engine.loop.request import (
    MAX_LOGPROBS,
    InvalidRequestError,
    PromptLogprobs,
    Request,
    SamplingParams,
    TokenLogprob,
)
from hashing import HASH_BYTES

if TYPE_CHECKING:
    from kvstore.config import CacheConfig

DEFAULT_SUMMARY_BLOCKS = 4096  # summaries kept (about 4 KB each at 16 tokens a block)


class Scores(NamedTuple):
    """Logprobs of `m` positions' next tokens, on the host."""

    logprob: np.ndarray  # [m] float32
    rank: np.ndarray  # [m] int32
    top_ids: np.ndarray  # [m, K] int32
    top_logprobs: np.ndarray  # [m, K] float32


class BlockSummary(NamedTuple):
    """A full block's prompt logprobs: position i's are of token_ids[i] given all before it
    (the first position of a prompt has none: NaN)."""

    token_ids: np.ndarray  # [block_size] int64
    scores: Scores  # m = block_size


def score(logits: torch.Tensor, next_ids: Sequence[int], k: int) -> Scores:
    """Logprobs of `next_ids[i]` under `logits[i]` ([m, vocab]), their ranks and the `k` most
    likely tokens of each row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(next_ids), device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)  # [m, 1]
    rank = (logprobs > chosen).sum(dim=1) + 1
    top = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    return Scores(
        chosen[:, 0].cpu().numpy(),
        rank.to(torch.int32).cpu().numpy(),
        top.indices.to(torch.int32).cpu().numpy(),
        top.values.cpu().numpy(),
    )


def record_output(request: Request, logits: torch.Tensor, token: int) -> None:
    """The sampled token's logprob under `logits` ([vocab], the request's row) and its
    `params.logprobs` most likely alternatives, appended before the token is emitted."""
    k = request.params.logprobs or 0
    scores = score(logits.unsqueeze(0), [token], max(k, 1))
    ids, values = scores.top_ids[0, :k].tolist(), scores.top_logprobs[0, :k].tolist()
    top = list(zip(ids, values, strict=True))
    logprobs_of(request).output.append(TokenLogprob(token, float(scores.logprob[0]), top))


class PromptScores:
    """A request's prompt logprobs so far: token t's entry, once `known[t]`."""

    def __init__(self, token_ids: Sequence[int], k: int):
        n = len(token_ids)
        self.token_ids = np.asarray(token_ids, dtype=np.int64)
        self.known = np.zeros(n, dtype=bool)
        self.known[0] = True  # the first token has no logprob: nothing to compute
        self.scores = Scores(
            np.full(n, np.nan, np.float32),
            np.zeros(n, np.int32),
            np.zeros((n, k), np.int32),
            np.zeros((n, k), np.float32),
        )

    @property
    def complete(self) -> bool:
        return bool(self.known.all())

    def set(self, start: int, scores: Scores) -> None:
        """Entries of tokens [start, start + m)."""
        end = start + len(scores.logprob)
        for mine, new in zip(self.scores, scores, strict=True):
            mine[start:end] = new
        self.known[start:end] = True

    def block_known(self, block: int, block_size: int) -> bool:
        return bool(self.known[block * block_size : (block + 1) * block_size].all())

    def block(self, block: int, block_size: int) -> BlockSummary:
        span = slice(block * block_size, (block + 1) * block_size)
        scores = Scores(*(a[span].copy() for a in self.scores))
        return BlockSummary(self.token_ids[span].copy(), scores)

    def copy(self) -> PromptScores:
        """Another request's, of the same prompt (its token ids are never written)."""
        twin = PromptScores.__new__(PromptScores)
        twin.token_ids, twin.known = self.token_ids, self.known.copy()
        twin.scores = Scores(*(a.copy() for a in self.scores))
        return twin

    def fill(self, block: int, summary: BlockSummary) -> None:
        self.set(block * len(summary.token_ids), summary.scores)

    def result(self, k: int) -> PromptLogprobs:
        """The entries with the `k` most likely tokens each (all must be known)."""
        lp, rank, ids, top = (a.tolist() for a in self.scores)
        logprobs = [None if math.isnan(v) else v for v in lp]
        tops = [list(zip(i[:k], t[:k], strict=True)) for i, t in zip(ids, top, strict=True)]
        ranks: list[int | None] = list(rank)
        ranks[0], tops[0] = None, None  # type: ignore[call-overload]
        logprobs[0] = None
        return PromptLogprobs(logprobs, ranks, tops)  # type: ignore[arg-type]


@dataclass(eq=False)
class RequestLogprobs:
    """What a request that asks has gathered: its output tokens' and its prompt's."""

    output: list[TokenLogprob] = field(default_factory=list)
    prompt: PromptScores | None = None


def logprobs_of(request: Request) -> RequestLogprobs:
    """The request's logprobs (made on first use)."""
    if request.logprobs is None:
        request.logprobs = RequestLogprobs()
    return request.logprobs


def prompt_scores(request: Request) -> PromptScores:
    state = logprobs_of(request)
    if state.prompt is None:
        state.prompt = PromptScores(request.token_ids, MAX_LOGPROBS)
    return state.prompt


def share_prompt(leader: Request, branch: Request) -> None:
    """A group's other sequence (engine/loop/group.py), released once its leader's prompt is
    computed, takes its prompt logprobs from the leader's (complete by then): its own prompt
    is never prefilled by itself. A copy, so that a branch that computes part of its prompt
    again (a window model's partial block, a resume) writes only its own."""
    state = leader.logprobs
    prompt = None if state is None else state.prompt
    if branch.params.prompt_logprobs is not None and prompt is not None:
        logprobs_of(branch).prompt = prompt.copy()


def prompt_logprobs_of(request: Request) -> PromptLogprobs:
    """The prompt logprobs of a request that asked, once its first token is sampled (all
    of its prompt's are known then)."""
    return prompt_scores(request).result(request.params.prompt_logprobs or 0)


def result_logprobs(request: Request) -> dict:
    """A finished request's `GenerateResult` fields `output_logprobs` and `prompt_logprobs`,
    those it asked for."""
    params, state, out = request.params, request.logprobs, {}
    if params.logprobs is not None:
        out["output_logprobs"] = list(state.output) if state is not None else []
    if params.prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs_of(request)
    return out


class Plan(NamedTuple):
    """How far a prompt-logprobs request may look up, and the summaries it will read."""

    limit: int  # leading tokens the lookup may cover (whole blocks, or the whole prompt)
    summaries: dict[int, BlockSummary]  # block -> its summary, for blocks it lacks


class Summaries:
    """`BlockSummary`s by lookup key, least recently used first out."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._table: OrderedDict[bytes, BlockSummary] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def get(self, key: bytes, token_ids: np.ndarray) -> BlockSummary | None:
        summary = self._table.get(key)
        if summary is None or not np.array_equal(summary.token_ids, token_ids):
            return None
        self._table.move_to_end(key)
        return summary

    def put(self, key: bytes, summary: BlockSummary) -> None:
        if self.capacity == 0:
            return
        self._table[key] = summary
        self._table.move_to_end(key)
        while len(self._table) > self.capacity:
            self._table.popitem(last=False)


class PromptLogprobCache:
    """Prompt logprobs of an engine's requests over its prefix cache (module docstring).
    `capacity` 0 keeps no summaries: every prompt-logprobs request then prefills its whole
    prompt."""

    def __init__(self, block_size: int, capacity: int = DEFAULT_SUMMARY_BLOCKS):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"prompt logprob summary blocks must be an int >= 0, got {capacity!r}")
        self.block_size = block_size
        self.summaries = Summaries(capacity)

    @classmethod
    def of(cls, config: CacheConfig, capacity: int | None = None) -> PromptLogprobCache:
        """An engine's, over a cache of `config` (None: the default capacity); it keeps no
        summaries when lookup keys are truncated (a test hook that forces collisions: a
        summary is found by its key)."""
        capacity = DEFAULT_SUMMARY_BLOCKS if capacity is None else capacity
        return cls(config.block_size, capacity if config.key_bytes == HASH_BYTES else 0)

    @staticmethod
    def wants(request: Request, start: int) -> bool:
        """Whether a row of the request fed from `start` needs every position's logits: the
        request wants prompt logprobs and some position's next token is in its prompt."""
        return request.params.prompt_logprobs is not None and start < len(request.token_ids) - 1

    def plan(self, request: Request, keys: Sequence[bytes]) -> Plan | None:
        """Where the lookup of a request being admitted stops (`keys`: its blocks' lookup
        keys); None when it needs no cut (no prompt logprobs wanted, or all gathered)."""
        if request.params.prompt_logprobs is None:
            return None
        scores, bs = prompt_scores(request), self.block_size
        if scores.complete:
            return None
        n, found = len(request.token_ids), {}
        full = min(n // bs, len(keys))
        for block in range(full):
            if scores.block_known(block, bs):
                continue
            summary = self.summaries.get(
                keys[block], scores.token_ids[block * bs : (block + 1) * bs]
            )
            if summary is None:
                return Plan(block * bs, found)
            found[block] = summary
        return Plan(full * bs, found)

    def admitted(self, request: Request, plan: Plan, num_cached: int) -> int:
        """The request's prompt logprobs of its `num_cached` cached tokens come from the
        plan's summaries; returns the first position to feed (its logits give the next
        token's logprob, so the last cached position is fed again, as for a whole-prompt
        hit: its K/V is read from the cached block, never written)."""
        scores = prompt_scores(request)
        for block, summary in plan.summaries.items():
            if block * self.block_size < num_cached:
                scores.fill(block, summary)
        return max(min(num_cached, len(request.token_ids)) - 1, 0)

    def record(
        self, request: Request, start: int, logits: torch.Tensor, keys: Sequence[bytes]
    ) -> None:
        """Logprobs of the prompt tokens after positions [start, start + len(logits)) (their
        logits), and summaries of the prompt blocks that became whole."""
        n = len(request.token_ids)
        m = min(len(logits), n - 1 - start)
        if m <= 0:
            return
        scores = prompt_scores(request)
        scores.set(
            start + 1, score(logits[:m], request.token_ids[start + 1 : start + 1 + m], MAX_LOGPROBS)
        )
        bs = self.block_size
        for block in range((start + 1) // bs, min((start + m) // bs + 1, n // bs, len(keys))):
            if scores.block_known(block, bs):
                self.summaries.put(keys[block], scores.block(block, bs))

    def record_rows(self, rows: Sequence[tuple[Request, int, int]], logits: torch.Tensor) -> None:
        """`record` each row (request, start, num_new: a scheduled row) that fed every
        position's logits (`logits`: theirs, in order, `num_new` each)."""
        parts = logits.split([num_new for _, _, num_new in rows])
        for (request, start, _), part in zip(rows, parts, strict=True):
            self.record(request, start, part, request.keys)


def check_logprobs(params: SamplingParams, batched: bool) -> None:
    """Logprobs are computed in the batched engine's steps only: InvalidRequestError naming
    the field a request asks them with otherwise."""
    asked = "logprobs" if params.logprobs is not None else "prompt_logprobs"
    if not batched and getattr(params, asked) is not None:
        why = f"{asked} needs the batched engine; this model is served one request at a time"
        raise InvalidRequestError(why, asked)
