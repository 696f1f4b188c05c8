"""Anthropic's Messages API request body (POST /v1/messages), validated, and its conversation
as chat messages: the server and the router render it through one chat template, so the
router hashes the blocks a replica looks up (the answers are in `anthropic_responses`).

Only text is served: a content block of another kind (image, document, tool_use,
tool_result, thinking, ...) and the fields that need them (`tools`, `tool_choice`,
`thinking`) are refused with a 400 naming them. `cache_control` breakpoints
(`{"type": "ephemeral", "ttl": "5m" | "1h"}`, at most 4) mark where the prompt is retained
(`engine/api/breakpoints.py` finds their token positions).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from engine.api import openai as p
from engine.api.errors import bad_request
from engine.api.validation import parse_body

MAX_BREAKPOINTS = 4  # Anthropic's bound on cache_control blocks in a request
CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}  # cache_control.ttl -> seconds
DEFAULT_TTL = "5m"
MAX_STOP_SEQUENCES = 16
BLOCK_SEPARATOR = "\n"  # between the text blocks of a turn (and of merged turns)
REFUSED_FIELDS = {
    "tools": "tool use is not supported",
    "tool_choice": "tool use is not supported",
    "thinking": "extended thinking is not supported",
    "top_k": "top_k is not supported; use top_p",
    "mcp_servers": "MCP servers are not supported",
    "container": "containers are not supported",
    "output_config": "output_config (output formats, effort) is not supported",
}


class Block(NamedTuple):
    """A text block of a turn; `ttl_s` of its cache_control breakpoint (None: none)."""

    text: str
    ttl_s: float | None


class Turn(NamedTuple):
    role: str  # "system", "user" or "assistant"
    blocks: tuple[Block, ...]

    def text(self) -> str:
        return BLOCK_SEPARATOR.join(block.text for block in self.blocks)


class Breakpoint(NamedTuple):
    """A cache_control: after block `block` of turn `turn`, retained `ttl_s` seconds."""

    turn: int
    block: int
    ttl_s: float


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: Any  # a string or text blocks (checked by `content_blocks`, naming the field)


class MessagesRequest(BaseModel):
    """The body of POST /v1/messages; `cache_salt` and `ignore_eos` are kvstore's extensions,
    as on OpenAI's routes."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: Any = None  # a string or text blocks
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted, unused
    cache_salt: Any = None  # validated by the server (400 with its own message)
    ignore_eos: bool = False  # extension (as OpenAI's routes): decode up to max_tokens
    tools: Any = None
    tool_choice: Any = None
    thinking: Any = None
    top_k: Any = None
    mcp_servers: Any = None
    container: Any = None
    output_config: Any = None
    cache_control: Any = None  # on the last block of the request (Anthropic's automatic caching)
    _turns: tuple[Turn, ...] = PrivateAttr(default=())

    def unsupported(self) -> list[tuple[str, str]]:
        out = [(name, why) for name, why in REFUSED_FIELDS.items() if _set(getattr(self, name))]
        stops = self.stop_sequences or []
        if len(stops) > MAX_STOP_SEQUENCES:
            out.append(("stop_sequences", f"at most {MAX_STOP_SEQUENCES} stop sequences"))
        if any(not s for s in stops):
            out.append(("stop_sequences", "a stop sequence must be a non-empty string"))
        return out

    @property
    def turns(self) -> tuple[Turn, ...]:
        """The system turn (if any), then the messages, a role's consecutive ones merged."""
        return self._turns

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop_sequences or ())

    @property
    def prompt_cache_key(self) -> None:
        """No routing key in Anthropic's API (OpenAI's field, read by the router)."""
        return None

    def chat_messages(self, turns: tuple[Turn, ...] | None = None) -> list[p.ChatMessage]:
        """The conversation (or `turns` of it) as chat messages for the chat template."""
        turns = self.turns if turns is None else turns
        return [p.ChatMessage(role=t.role, content=t.text()) for t in turns]  # type: ignore[arg-type]

    def breakpoints(self) -> list[Breakpoint]:
        return [
            Breakpoint(t, b, block.ttl_s)
            for t, turn in enumerate(self.turns)
            for b, block in enumerate(turn.blocks)
            if block.ttl_s is not None
        ]

    def cut(self, point: Breakpoint) -> tuple[Turn, ...]:
        """The conversation up to and including the breakpoint's block."""
        turn = self.turns[point.turn]
        return (*self.turns[: point.turn], Turn(turn.role, turn.blocks[: point.block + 1]))


def _set(value: object) -> bool:
    """A refused field counts when sent with a value ({"type": "disabled"} is no thinking)."""
    if isinstance(value, dict) and value.get("type") == "disabled":
        return False
    return value is not None and value != []


def cache_ttl(control: object, where: str) -> float | None:
    """The TTL of a block's `cache_control` (None: none); a 400 naming the field."""
    if control is None:
        return None
    if not isinstance(control, dict):
        raise bad_request("cache_control must be an object", where)
    if control.get("type") != "ephemeral":
        why = f"cache_control type {control.get('type')!r} is unknown; use 'ephemeral'"
        raise bad_request(why, f"{where}.type")
    ttl = control.get("ttl", DEFAULT_TTL)
    if ttl not in CACHE_TTLS:
        raise bad_request(f"cache_control ttl {ttl!r} is unknown; use '5m' or '1h'", f"{where}.ttl")
    return CACHE_TTLS[ttl]


def content_blocks(content: object, where: str) -> tuple[Block, ...]:
    """A message's (or the system's) content as text blocks; a 400 naming what is refused
    (an empty text, as Anthropic's API refuses it)."""
    if isinstance(content, str):
        if not content:
            raise bad_request("a message's text must be non-empty", where)
        return (Block(content, None),)
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of content blocks", where)
    return tuple(_block(block, f"{where}.{i}") for i, block in enumerate(content))


def _block(block: object, where: str) -> Block:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request("a content block must be an object with a string 'type'", where)
    if block["type"] != "text":
        why = f"content blocks of type {block['type']!r} are not supported; send text blocks"
        raise bad_request(why, f"{where}.type", "unsupported_parameter")
    if not isinstance(block.get("text"), str):
        raise bad_request("a text block's text must be a string", f"{where}.text")
    if not block["text"]:
        raise bad_request("a text block's text must be non-empty", f"{where}.text")
    return Block(block["text"], cache_ttl(block.get("cache_control"), f"{where}.cache_control"))


def _turns(req: MessagesRequest) -> list[Turn]:
    """The system turn, then the messages, consecutive ones of one role merged into one."""
    turns = []
    system = () if req.system is None else content_blocks(req.system, "system")
    if system:
        turns.append(Turn("system", system))
    for i, message in enumerate(req.messages):
        blocks = content_blocks(message.content, f"messages.{i}.content")
        if turns and turns[-1].role == message.role:
            turns[-1] = Turn(message.role, turns[-1].blocks + blocks)
        else:
            turns.append(Turn(message.role, blocks))
    return turns


def conversation(req: MessagesRequest) -> tuple[Turn, ...]:
    """The request's turns (a top-level cache_control on the last block); a 400 for refused
    content or too many breakpoints."""
    turns = _turns(req)
    if turns[-1].role != "user":
        why = "the last message must be the user's (assistant prefill is not supported)"
        raise bad_request(why, "messages")
    automatic = cache_ttl(req.cache_control, "cache_control")
    if automatic is not None and turns[-1].blocks:
        last = turns[-1].blocks[-1]
        turns[-1] = Turn("user", (*turns[-1].blocks[:-1], Block(last.text, automatic)))
    count = sum(block.ttl_s is not None for turn in turns for block in turn.blocks)
    if count > MAX_BREAKPOINTS:
        why = f"{count} blocks have cache_control; at most {MAX_BREAKPOINTS} are allowed"
        raise bad_request(why, "cache_control")
    return tuple(turns)


class CountTokensRequest(MessagesRequest):
    """The body of POST /v1/messages/count_tokens: a message's, without max_tokens."""

    max_tokens: int | None = Field(default=None, ge=1)  # type: ignore[assignment]


def parse_messages(data: object, model: type[MessagesRequest] = MessagesRequest) -> MessagesRequest:
    """The validated request of a JSON body; a 400 naming the first bad field."""
    req = parse_body(model, data)
    req._turns = conversation(req)
    return req
