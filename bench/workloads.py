"""Seeded, reproducible prompt workloads for the hit-rate benchmark.

Every generator is a frozen config dataclass whose `generate()` returns the prompts as
`Request`s (arrival time in ms, token ids) sorted by arrival; the same config (seed included)
always yields the same requests. Token ids are uniform random in [0, vocab_size), so two
prompts share a prefix only where the workload makes them share one.

- shared-prefix: SGLang's generated-shared-prefix benchmark with a popularity skew;
- multiturn: chat clients whose every turn resends the whole history;
- rag: few-shot / RAG prompts built from a pool of documents of skewed popularity;
- conversation: a mix like a production chat service (shared system prompts, multi-turn
  sessions of varied length, a long tail of one-off prompts, heavy-tailed lengths).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from bench.traces import Request

__all__ = [
    "WORKLOADS",
    "ConversationConfig",
    "MultiTurnConfig",
    "RagConfig",
    "SharedPrefixConfig",
    "WorkloadError",
    "make_workload",
]


class WorkloadError(ValueError):
    """A workload parameter is invalid; the message names it."""


def _check_positive(cfg: object, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise WorkloadError(f"{name} must be a positive number, got {value!r}")


def _check_nonneg(cfg: object, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise WorkloadError(f"{name} must be >= 0, got {value!r}")


def zipf_weights(n: int, s: float) -> np.ndarray:
    """Probabilities of ranks 1..n proportional to rank^-s (s = 0: uniform)."""
    w = np.arange(1, n + 1, dtype=np.float64) ** -s
    return w / w.sum()


def poisson_arrivals(rng: np.random.Generator, n: int, rate_per_s: float) -> np.ndarray:
    """n arrival times in ms of a Poisson process of `rate_per_s` requests a second."""
    return np.cumsum(rng.exponential(1000.0 / rate_per_s, n))


class _Tokens:
    def __init__(self, rng: np.random.Generator, vocab_size: int):
        self.rng, self.vocab_size = rng, vocab_size

    def __call__(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.vocab_size, int(n), dtype=np.uint32)


def _sorted(requests: list[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: r.timestamp_ms)


@dataclass(frozen=True)
class SharedPrefixConfig:
    """Groups of prompts sharing a system prompt, each with its own question.

    Defaults are SGLang's generated-shared-prefix ones (64 groups x 16 prompts, 2048-token
    system prompts, 128-token questions). Each prompt's group is drawn from a Zipf(`zipf_s`)
    popularity over the groups (`zipf_s=0`: exactly `prompts_per_group` each, as SGLang);
    arrivals are in random order, a Poisson process of `request_rate` prompts a second.
    """

    num_groups: int = 64
    prompts_per_group: int = 16
    system_prompt_len: int = 2048
    question_len: int = 128
    zipf_s: float = 1.0
    request_rate: float = 10.0
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        _check_positive(self, "num_groups", "prompts_per_group", "question_len", "request_rate")
        _check_positive(self, "vocab_size")
        _check_nonneg(self, "system_prompt_len", "zipf_s")

    def generate(self) -> list[Request]:
        rng = np.random.default_rng(self.seed)
        tokens = _Tokens(rng, self.vocab_size)
        systems = [tokens(self.system_prompt_len) for _ in range(self.num_groups)]
        n = self.num_groups * self.prompts_per_group
        if self.zipf_s == 0:
            groups = rng.permutation(np.repeat(np.arange(self.num_groups), self.prompts_per_group))
        else:
            groups = rng.choice(self.num_groups, n, p=zipf_weights(self.num_groups, self.zipf_s))
        times = poisson_arrivals(rng, n, self.request_rate)
        return [
            Request(float(t), np.concatenate([systems[g], tokens(self.question_len)]))
            for t, g in zip(times, groups, strict=True)
        ]


@dataclass(frozen=True)
class MultiTurnConfig:
    """Chat clients: each sends `num_turns` prompts; a turn's prompt is the shared system
    prompt plus the whole history (every earlier user turn and answer) plus a new user turn
    of `turn_tokens` tokens; answers are `answer_tokens` long. Clients start as a Poisson
    process of `client_rate` a second; a client's next turn comes an exponential think time
    (mean `think_time_s`) after its previous one. Requests interleave by simulated time."""

    num_clients: int = 64
    num_turns: int = 8
    turn_tokens: int = 256
    answer_tokens: int = 256
    system_prompt_len: int = 512
    think_time_s: float = 30.0
    client_rate: float = 1.0
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        _check_positive(self, "num_clients", "num_turns", "turn_tokens", "think_time_s")
        _check_positive(self, "client_rate", "vocab_size")
        _check_nonneg(self, "answer_tokens", "system_prompt_len")

    def generate(self) -> list[Request]:
        rng = np.random.default_rng(self.seed)
        tokens = _Tokens(rng, self.vocab_size)
        system = tokens(self.system_prompt_len)
        starts = poisson_arrivals(rng, self.num_clients, self.client_rate)
        out = []
        for start in starts:
            history, t = system, float(start)
            for _ in range(self.num_turns):
                prompt = np.concatenate([history, tokens(self.turn_tokens)])
                out.append(Request(t, prompt, self.answer_tokens))
                history = np.concatenate([prompt, tokens(self.answer_tokens)])
                t += rng.exponential(1000.0 * self.think_time_s)
        return _sorted(out)


@dataclass(frozen=True)
class RagConfig:
    """Few-shot / RAG prompts: a shared instruction, then `docs_per_prompt` distinct documents
    from a pool of `num_docs` (each `doc_len` tokens) drawn by Zipf(`zipf_s`) popularity, in
    draw order (most relevant first; `sorted_docs=True` orders them by document id, as a
    fixed few-shot pool would), then a question. Poisson arrivals of `request_rate` a second.
    """

    num_requests: int = 2048
    num_docs: int = 1000
    docs_per_prompt: int = 4
    doc_len: int = 512
    question_len: int = 64
    system_prompt_len: int = 128
    zipf_s: float = 1.0
    sorted_docs: bool = False
    request_rate: float = 10.0
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        _check_positive(self, "num_requests", "num_docs", "docs_per_prompt", "doc_len")
        _check_positive(self, "question_len", "request_rate", "vocab_size")
        _check_nonneg(self, "system_prompt_len", "zipf_s")
        if self.docs_per_prompt > self.num_docs:
            raise WorkloadError(
                f"docs_per_prompt ({self.docs_per_prompt}) must be <= num_docs ({self.num_docs})"
            )

    def generate(self) -> list[Request]:
        rng = np.random.default_rng(self.seed)
        tokens = _Tokens(rng, self.vocab_size)
        system = tokens(self.system_prompt_len)
        docs = [tokens(self.doc_len) for _ in range(self.num_docs)]
        weights = zipf_weights(self.num_docs, self.zipf_s)
        times = poisson_arrivals(rng, self.num_requests, self.request_rate)
        out = []
        for t in times:
            picked = rng.choice(self.num_docs, self.docs_per_prompt, replace=False, p=weights)
            if self.sorted_docs:
                picked = np.sort(picked)
            parts = [system, *(docs[d] for d in picked), tokens(self.question_len)]
            out.append(Request(float(t), np.concatenate(parts)))
        return out


@dataclass(frozen=True)
class ConversationConfig:
    """A production-chat-like mix. Sessions arrive as a Poisson process (`session_rate` a
    second). A session picks one of `num_system_prompts` system prompts by Zipf(`zipf_s`)
    popularity. With probability `one_off_fraction` it is a single prompt; otherwise it has
    1 + Geometric turns (mean `mean_turns` in all). The first user message is lognormal
    (median `first_turn_median`, shape `first_turn_sigma`: a heavy tail of pasted documents),
    later ones lognormal (`turn_median`, `turn_sigma`), answers lognormal (`answer_median`,
    0.6); every turn resends the whole history. Think times are lognormal (median
    `think_median_s`, shape `think_sigma`). Prompts stop growing at `max_prompt_tokens`
    (the session ends)."""

    num_sessions: int = 1000
    session_rate: float = 0.5
    num_system_prompts: int = 4
    system_prompt_len: int = 700
    zipf_s: float = 1.0
    one_off_fraction: float = 0.55
    mean_turns: float = 3.0
    first_turn_median: float = 3000.0
    first_turn_sigma: float = 1.0
    turn_median: float = 200.0
    turn_sigma: float = 1.2
    answer_median: float = 300.0
    think_median_s: float = 90.0
    think_sigma: float = 0.9
    max_prompt_tokens: int = 120_000
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        _check_positive(self, "num_sessions", "session_rate", "num_system_prompts")
        _check_positive(self, "first_turn_median", "turn_median", "answer_median")
        _check_positive(self, "think_median_s", "max_prompt_tokens", "vocab_size")
        _check_nonneg(self, "system_prompt_len", "zipf_s", "first_turn_sigma", "turn_sigma")
        _check_nonneg(self, "think_sigma")
        if not 0.0 <= self.one_off_fraction <= 1.0:
            raise WorkloadError(f"one_off_fraction must be in [0, 1], got {self.one_off_fraction}")
        if self.mean_turns < 1:
            raise WorkloadError(f"mean_turns must be >= 1, got {self.mean_turns}")

    def _num_turns(self, rng: np.random.Generator) -> int:
        if rng.random() < self.one_off_fraction:
            return 1
        return int(rng.geometric(1.0 / self.mean_turns))

    def _lognormal(self, rng: np.random.Generator, median: float, sigma: float) -> int:
        return max(1, round(median * np.exp(sigma * rng.standard_normal())))

    def generate(self) -> list[Request]:
        rng = np.random.default_rng(self.seed)
        tokens = _Tokens(rng, self.vocab_size)
        systems = [tokens(self.system_prompt_len) for _ in range(self.num_system_prompts)]
        weights = zipf_weights(self.num_system_prompts, self.zipf_s)
        out: list[Request] = []
        for start in poisson_arrivals(rng, self.num_sessions, self.session_rate):
            history = systems[rng.choice(self.num_system_prompts, p=weights)]
            user = self._lognormal(rng, self.first_turn_median, self.first_turn_sigma)
            t = float(start)
            for _ in range(self._num_turns(rng)):
                prompt = np.concatenate([history, tokens(user)])
                if len(prompt) > self.max_prompt_tokens:
                    break
                answer = self._lognormal(rng, self.answer_median, 0.6)
                out.append(Request(t, prompt, answer))
                history = np.concatenate([prompt, tokens(answer)])
                user = self._lognormal(rng, self.turn_median, self.turn_sigma)
                t += 1000.0 * self._lognormal(rng, self.think_median_s, self.think_sigma)
        return _sorted(out)


WORKLOADS: dict[str, type] = {
    "shared-prefix": SharedPrefixConfig,
    "multiturn": MultiTurnConfig,
    "rag": RagConfig,
    "conversation": ConversationConfig,
}


def _convert(field: dataclasses.Field, text: str) -> object:
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    try:
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        return int(text) if kind == "int" else float(text)
    except ValueError:
        raise WorkloadError(f"{field.name} expects a {kind}, got {text!r}") from None


def parse_params(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """`--param KEY=VALUE` items as a dict (later keys win); `WorkloadError` for one without =."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise WorkloadError(f"--param expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def make_workload(name: str, params: dict[str, str] | None = None) -> object:
    """The config of workload `name` with fields overridden from strings ("key" -> "value")."""
    if name not in WORKLOADS:
        raise WorkloadError(f"unknown workload {name!r}; choose one of {list(WORKLOADS)}")
    cls = WORKLOADS[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, text in (params or {}).items():
        if key not in fields:
            raise WorkloadError(f"{name} has no parameter {key!r}; it has {list(fields)}")
        values[key] = _convert(fields[key], text)
    return cls(**values)
