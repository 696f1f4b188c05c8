"""OpenAI's logprobs objects, from the engine's per-token logprobs (no torch, no engine).

What a request asks (`Asked`): chat's `logprobs` / `top_logprobs` (0..20) and completions'
`logprobs` (0..5) are of the tokens it generates; completions' `echo` returns the prompt's
text before the completion, and with `logprobs` the prompt tokens' logprobs too (the first
token's are null); vLLM's `prompt_logprobs` (0..20) adds its `prompt_logprobs` field. All
are of the model's raw distribution: log_softmax of the logits before temperature and
top_p, as vLLM returns by default. `max_tokens` 0 (with echo only) still has the engine
sample one token, whose logits the prompt's last position gives anyway, and drops it.

Shapes: chat's `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`;
completions' `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`,
whose dict of alternatives also holds the chosen token (as vLLM's), and whose offsets are
into the choice's text (a stream's run on over its chunks). A token's text is its id
decoded alone; -inf is sent as -9999.0 (JSON has no infinity), as OpenAI and vLLM do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

LOGPROB_FLOOR = -9999.0


class Asked(NamedTuple):
    """The logprobs a request asks of the engine, and what its answer holds."""

    logprobs: int | None  # alternatives per generated token; None: no logprobs
    prompt_logprobs: int | None  # alternatives per prompt token (the engine's); None: none
    echo: bool  # the completion's text starts with the prompt's (and its logprobs with
    # the prompt's, when `logprobs` is set)
    echo_only: bool  # max_tokens 0: the prompt (and its logprobs) only
    vllm_prompt_logprobs: int | None  # vLLM's `prompt_logprobs` field, with this many


def asked(req: Any) -> Asked:
    """What a chat or completion request (engine/api/openai.py) asks."""
    if hasattr(req, "messages"):  # chat
        output = (req.top_logprobs or 0) if req.logprobs else None
        return Asked(output, None, False, False, None)
    echo, vllm = bool(req.echo), req.prompt_logprobs
    prompt = [k for k in (req.logprobs if echo else None, vllm) if k is not None]
    echo_only = echo and req.max_tokens == 0
    return Asked(req.logprobs, max(prompt, default=None), echo, echo_only, vllm)


class Position(NamedTuple):
    """One token of a choice's logprobs: its id, logprob (None: a prompt's first token) and
    most likely alternatives (id, logprob), most likely first."""

    token_id: int
    logprob: float | None
    top: Sequence[tuple[int, float]] | None


def output_positions(entries: Sequence[Any]) -> list[Position]:
    """Generated tokens' positions (the engine's `TokenLogprob`s)."""
    return [Position(e.token_id, e.logprob, e.top) for e in entries]


def prompt_positions(token_ids: Sequence[int], prompt: Any) -> list[Position]:
    """Prompt tokens' positions (the engine's `PromptLogprobs` of `token_ids`)."""
    return [Position(*p) for p in zip(token_ids, prompt.logprobs, prompt.top, strict=True)]


class TokenTexts:
    """Each token id's text: the id decoded alone (cached)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


def _floor(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, LOGPROB_FLOOR)


class LogprobFormat:
    """The logprobs objects of one choice: chat's entries or completions' arrays, with `k`
    alternatives each; completions' text offsets run on from call to call."""

    def __init__(self, kind: str, k: int, text: Callable[[int], str]):
        self.kind, self.k, self.text = kind, k, text
        self.offset = 0  # completions: where the next token's text starts

    def __call__(self, positions: Sequence[Position]) -> dict:
        if self.kind == "chat":
            return {"content": [self._chat_entry(p) for p in positions]}
        return self._completion(positions)

    def _token(self, token_id: int, logprob: float | None) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": _floor(logprob), "bytes": list(text.encode())}

    def _chat_entry(self, p: Position) -> dict:
        top = [self._token(i, lp) for i, lp in (p.top or ())[: self.k]]
        return {**self._token(p.token_id, p.logprob), "top_logprobs": top}

    def _completion(self, positions: Sequence[Position]) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}  # fmt: skip
        for p in positions:
            token = self.text(p.token_id)
            out["tokens"].append(token)
            out["token_logprobs"].append(_floor(p.logprob))
            out["top_logprobs"].append(self._alternatives(p))
            out["text_offset"].append(self.offset)
            self.offset += len(token)
        return out

    def _alternatives(self, p: Position) -> dict[str, float] | None:
        if p.logprob is None:
            return None
        top = {self.text(i): _floor(lp) for i, lp in (p.top or ())[: self.k]}
        return top | {self.text(p.token_id): _floor(p.logprob)}


def vllm_prompt_logprobs(
    positions: Sequence[Position], ranks: Sequence[int | None], k: int, text: Callable
) -> list[dict | None]:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token id:
    {logprob, rank, decoded_token}} of the token and its `k` most likely alternatives."""
    out: list[dict | None] = []
    for p, rank in zip(positions, ranks, strict=True):
        if p.logprob is None:
            out.append(None)
            continue
        entries = {str(i): {"logprob": _floor(lp), "rank": r + 1, "decoded_token": text(i)}
                   for r, (i, lp) in enumerate((p.top or ())[:k])}  # fmt: skip
        token = {"logprob": _floor(p.logprob), "rank": rank, "decoded_token": text(p.token_id)}
        out.append({str(p.token_id): token, **entries})
    return out


def echo_text(want: Asked, req: Any, decode: Callable[[Sequence[int]], str]) -> str:
    """The text each choice starts with: the prompt as sent, or its token ids decoded, when
    echoed; "" otherwise."""
    if not want.echo:
        return ""
    prompt = req.single_prompt()
    return prompt if isinstance(prompt, str) else decode(prompt)


def logprob_format(kind: str, want: Asked, text: Callable[[int], str]) -> LogprobFormat | None:
    """A choice's logprobs objects (each choice its own: completions' offsets run on)."""
    return None if want.logprobs is None else LogprobFormat(kind, want.logprobs, text)


def shape_choice(
    choice: dict, kind: str, want: Asked, result: Any, prompt_ids: Sequence[int], echo: str,
    text: Callable[[int], str],
) -> dict:  # fmt: skip
    """A non-streamed choice with what `want` asks: the echoed prompt text `echo` before
    its text, its logprobs (the prompt's first when echoed), vLLM's `prompt_logprobs`."""
    positions = output_positions(result.output_logprobs or ())
    prompt = result.prompt_logprobs
    if want.echo:
        choice["text"] = echo + choice["text"]
        if want.logprobs is not None:
            positions = prompt_positions(prompt_ids, prompt) + positions
    if want.logprobs is not None:
        choice["logprobs"] = LogprobFormat(kind, want.logprobs, text)(positions)
    if want.vllm_prompt_logprobs is not None:
        k, every = want.vllm_prompt_logprobs, prompt_positions(prompt_ids, prompt)
        choice["prompt_logprobs"] = vllm_prompt_logprobs(every, prompt.ranks, k, text)
    return choice


def shape_choices(
    body: dict, kind: str, want: Asked, results: Sequence[Any], prompt_ids: Sequence[int],
    echo: str, text: Callable[[int], str],
) -> dict:  # fmt: skip
    """`shape_choice` each of the body's choices with its result (`results`: in their
    order, as `answered`)."""
    for choice, result in zip(body["choices"], results, strict=True):
        shape_choice(choice, kind, want, result, prompt_ids, echo, text)
    return body


def answered(want: Asked, result: Any) -> Any:
    """The engine's `GenerateResult` as answered: an echo-only (max_tokens 0) request's one
    sampled token is dropped."""
    if not want.echo_only:
        return result
    output = None if result.output_logprobs is None else []
    return result._replace(output_token_ids=[], text="", finish_reason="length",
                           output_logprobs=output)  # fmt: skip
