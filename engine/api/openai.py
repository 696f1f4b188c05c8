"""OpenAI's request bodies for /v1/completions and /v1/chat/completions, validated with
pydantic (the response objects are in `openai_responses`).

Only what the engine can honour is accepted; a field that needs something it cannot do is
refused with a 400 that says so, never silently ignored. Logprobs (`logprobs`,
`top_logprobs`, and `echo` with `logprobs` or vLLM's `prompt_logprobs` for the prompt's) are
of the model's raw distribution, before temperature and top_p (engine/api/logprobs.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from starlette.requests import Request as HTTPRequest

from engine.api.body import read_json
from engine.api.errors import bad_request
from engine.api.validation import parse_body

MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, vLLM's prompt_logprobs (the engine's bound)
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs (OpenAI's bound)
MAX_PROMPT_CACHE_KEY_CHARS = 64  # a routing hint, not a document (docs/DEPLOY.md)
RETENTION_TTL_S = {"in_memory": None, "24h": 86400.0}  # prompt_cache_retention -> TTL

# fields OpenAI's API declares nullable whose null means their default value
NULL_MEANS_DEFAULT = ("temperature", "top_p", "n", "presence_penalty", "frequency_penalty",
                      "stream", "max_tokens", "echo", "logprobs")  # fmt: skip


class StreamOptions(BaseModel):
    """OpenAI's stream options (an unknown key is a 400: it would be an option not taken)."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool = True  # OpenAI's padding of stream events: none is sent here


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)  # null: the default
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch can seed
    stop: str | list[str] | None = None  # each one non-empty (`unsupported`)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: Any = None  # validated by the server (400 with its own message)
    n: int | None = Field(default=1, ge=1)  # at most the server's --max-n (api/choices.py)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # extension (as vLLM): decode up to max_tokens
    return_token_ids: bool = False  # extension: each choice carries its output token ids
    # "24h": the whole prompt is retained for 24 h; "in_memory" (the default): no retention
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # the router keeps requests of one key on one replica while its load allows
    prompt_cache_key: str | None = Field(
        default=None, min_length=1, max_length=MAX_PROMPT_CACHE_KEY_CHARS
    )

    @field_validator(*NULL_MEANS_DEFAULT, mode="after", check_fields=False)
    @classmethod
    def _null_is_the_default(cls, value: object, info: ValidationInfo) -> object:
        """OpenAI's API lets a client send null for these: it means the default."""
        return cls.model_fields[info.field_name].default if value is None else value

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, why) of every set field the engine cannot honour."""
        out = []
        if self.presence_penalty or self.frequency_penalty:
            out.append(("presence_penalty", "penalties are not supported; leave them at 0"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported"))
        if isinstance(self.stop, list) and len(self.stop) > 4:
            out.append(("stop", "at most 4 stop sequences"))
        if any(not s for s in self.stop_strings):
            out.append(("stop", "a stop sequence must be a non-empty string"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options needs stream=true"))
        return out

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def retention_ttl_s(self) -> float | None:
        """How long the whole prompt is retained (None: not retained)."""
        return RETENTION_TTL_S[self.prompt_cache_retention or "in_memory"]


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # 0: with echo only
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's
    best_of: int | None = Field(default=None, ge=1)  # >= n (api/choices.py)
    suffix: str | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # chat's

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.top_logprobs is not None:
            why = "top_logprobs is chat's; on /v1/completions, logprobs=N gives N alternatives"
            out.append(("top_logprobs", why))
        if self.max_tokens == 0 and not self.echo:
            out.append(("max_tokens", "max_tokens 0 needs echo=true (it returns the prompt)"))
        if self.prompt_logprobs is not None and self.stream:
            out.append(("prompt_logprobs", "prompt_logprobs is not streamed; send stream=false"))
        if self.suffix:
            out.append(("suffix", "suffix (insertion) is not supported"))
        return out

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string or token ids (a batch of one is unwrapped)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise bad_request("send one prompt per request (a batch of one is fine)", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise bad_request("prompt is empty; give at least one token", "prompt")
        return prompt


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    best_of: int | None = Field(default=None, ge=1)  # completions' (vLLM takes it on chat)
    echo: bool | None = False  # completions' (vLLM echoes the last message)

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.best_of not in (None, 1):
            out.append(("best_of", "best_of is not served on chat; use n, or /v1/completions"))
        if self.echo:
            out.append(("echo", "echo is not served on chat; use /v1/completions"))
        if self.top_logprobs is not None and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs needs logprobs=true"))
        if self.tools:
            out.append(("tools", "tool calling is not supported"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append(("response_format", "only response_format type 'text' is supported"))
        return out

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


OpenAIRequest = CompletionRequest | ChatRequest
REQUEST_MODELS: dict[str, type[OpenAIRequest]] = {
    "completion": CompletionRequest,
    "chat": ChatRequest,
}


async def read_request(request: HTTPRequest, kind: str, limit: int) -> tuple[object, Any]:
    """The JSON body (at most `limit` bytes) and its validated request of `kind`
    ("completion" or "chat")."""
    data = await read_json(request, limit)
    return data, parse_body(REQUEST_MODELS[kind], data)
