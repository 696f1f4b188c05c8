"""A request's prompt as token ids: one rendering for the server and the router, so the
router hashes exactly the blocks a replica will look up."""

from __future__ import annotations

from typing import Any

from engine.api import openai as p
from engine.api.anthropic import MessagesRequest
from engine.api.errors import bad_request


def simple_chat_prompt(messages: list[p.ChatMessage]) -> str:
    """The template for tokenizers without one: "<role>: <content>\\n" per message, then
    "assistant: " (the tokenizer adds its own special tokens, such as BOS)."""
    return "".join(f"{m.role}: {m.text()}\n" for m in messages) + "assistant: "


def chat_ids(tokenizer: Any, messages: list[p.ChatMessage]) -> list[int]:
    """The messages through the tokenizer's chat template (400 if the template refuses)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(simple_chat_prompt(messages))["input_ids"]
    plain = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # the template's own checks (role order, ...)
        message = f"the chat template refused the messages: {e}"
        raise bad_request(message, "messages") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(
    tokenizer: Any, req: p.CompletionRequest | p.ChatRequest | MessagesRequest
) -> list[int]:
    """Token ids of a completion's prompt (text or ids), a chat's messages or an Anthropic
    conversation (its turns as chat messages)."""
    if isinstance(req, MessagesRequest):
        return list(chat_ids(tokenizer, req.chat_messages()))
    if isinstance(req, p.ChatRequest):
        return list(chat_ids(tokenizer, req.messages))
    prompt = req.single_prompt()
    return list(tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt)
