"""`kvstore` command line. Subcommands live in `COMMANDS`; others register with `command()`.

Cache flags are derived from `CacheConfig` fields (`--block-size` -> block_size, ...), so
every subcommand that builds a cache shares them via `add_cache_arguments`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
import typing
from collections.abc import Callable
from dataclasses import fields
from typing import NamedTuple

from kvstore.config import CacheConfig, ConfigError

_HIDDEN_CACHE_FIELDS = ("secret", "key_bytes")  # secret comes from $KVSTORE_SECRET only
SECRET_ENV = "KVSTORE_SECRET"


class Command(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    """Register `run(args) -> exit code` as subcommand `name`."""

    def register(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = Command(help, add_arguments, run)
        return run

    return register


# --- cache flags <-> CacheConfig ------------------------------------------------------------


def _flag_type(hint: object) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return args[0] if is_union else hint  # type: ignore[return-value]


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per CacheConfig field (default None = the field's default)."""
    hints = typing.get_type_hints(CacheConfig)
    group = parser.add_argument_group("cache (CacheConfig fields)")
    for f in fields(CacheConfig):
        if f.name in _HIDDEN_CACHE_FIELDS:
            continue
        flag = "--" + f.name.replace("_", "-")
        group.add_argument(
            flag,
            dest=f"cache_{f.name}",
            type=_flag_type(hints[f.name]),
            default=None,
            metavar=f.name.upper(),
            help=f"default {f.default!r}",
        )


def cache_config_from_args(args: argparse.Namespace, **overrides: object) -> CacheConfig:
    """CacheConfig from the parsed flags; `overrides` are defaults the flags can still override."""
    values = dict(overrides)
    for f in fields(CacheConfig):
        value = getattr(args, f"cache_{f.name}", None)
        if value is not None:
            values[f.name] = value
    if os.environ.get(SECRET_ENV):
        values["secret"] = os.environ[SECRET_ENV]
    return CacheConfig(**values)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' or a local model directory")
    parser.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16")
    parser.add_argument(
        "--model-revision",
        default=None,
        help="pin the fingerprint to this string instead of hashing weights",
    )


def load_engine(args: argparse.Namespace, **cache_defaults: object):
    """(LoadedModel, Engine) from model and cache flags; the model goes on the cache device."""
    from transformers.utils import logging as hf_logging

    from engine.engine import Engine
    from engine.model import load_model
    from kvstore.pool import resolve_device

    hf_logging.disable_progress_bar()
    config = cache_config_from_args(args, **cache_defaults)
    model = load_model(args.model, args.dtype, resolve_device(config.device), args.model_revision)
    return model, Engine(model, config)


# --- generate -------------------------------------------------------------------------------


def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized by the model's tokenizer)")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    add_model_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_cache_arguments(parser)


def _parse_ids(text: str) -> list[int]:
    from engine.engine import InvalidRequestError

    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        msg = f"--prompt-ids must be comma-separated ints, got {text!r}"
        raise InvalidRequestError(msg) from None


@command("generate", "generate from one prompt", _generate_arguments)
def run_generate(args: argparse.Namespace) -> int:
    from engine.engine import SamplingParams

    params = SamplingParams(
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    prompt = args.prompt if args.prompt is not None else _parse_ids(args.prompt_ids)
    _, engine = load_engine(args)
    with engine:
        result = engine.generate([prompt], params)[0]
    out = {
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "output_token_ids": result.output_token_ids,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "ttft_s": result.ttft_s,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(result.text)
        print(
            f"[{result.prompt_tokens} prompt tokens, {result.cached_tokens} cached, "
            f"{len(result.output_token_ids)} generated, ttft {result.ttft_s * 1e3:.1f} ms]"
        )
    return 0


# --- demo -----------------------------------------------------------------------------------


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--max-tokens", type=int, default=16)


@command("demo", "tiny model: a 4-turn chat and 8 prompts sharing a system prompt", _demo_arguments)
def run_demo(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    rows = demo_requests(args.max_tokens)
    report = {
        "requests": rows,
        "all_identical": all(r["identical"] for r in rows),
        "runtime_s": time.perf_counter() - start,
    }
    if args.json:
        print(json.dumps(report))
    else:
        _print_demo_table(report)
    return 0 if report["all_identical"] else 1


_SYSTEM_RULES = (
    "answer in plain words and keep every reply short",
    "when a question is ambiguous, ask one clarifying question first",
    "never invent facts; say that you do not know instead",
    "prefer concrete examples over abstract explanations",
    "quote numbers with their units and their source",
    "use lists only when the order of the steps matters",
    "summarize long documents before answering questions about them",
    "keep code samples small, complete and runnable",
)
SYSTEM_PROMPT = "You are the kvstore demo assistant, a careful and friendly helper. " + " ".join(
    f"Rule {i + 1}: {rule}, and remember rule {i + 1} in every turn of the conversation."
    for i, rule in enumerate(_SYSTEM_RULES)
)
CHAT_TURNS = (
    "Hello! What does a prefix cache store, in one sentence?",
    "And why does the last prompt token always have to be computed?",
    "How would you size the device pool for a chat service?",
    "Thanks. Summarize our conversation in one line.",
)
BATCH_QUESTIONS = tuple(
    f"Question {i + 1}: explain topic number {i + 1} of the course, {topic}, to a beginner."
    for i, topic in enumerate(
        (
            "hash chains",
            "radix trees",
            "paged memory",
            "eviction",
            "spill tiers",
            "checksums",
            "circuit breakers",
            "time to first token",
        )
    )
)


def demo_requests(max_tokens: int) -> list[dict]:
    """Run the demo's 12 requests through the engine and compare each with a no-cache run."""
    from engine.engine import Engine, SamplingParams, reference_generate
    from engine.model import END_OF_TURN, load_model

    model = load_model("tiny")
    tok = model.tokenizer
    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    reference_generate(model, list(range(64)), 2)  # warm-up, not reported
    system = {"role": "system", "content": SYSTEM_PROMPT}

    def chat_ids(question: str) -> list[int]:
        messages = [system, {"role": "user", "content": question}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    def compare(name: str, ids: list[int], result) -> dict:
        ref, ttft_nocache = reference_generate(model, ids, len(result.output_token_ids))
        return {
            "name": name,
            "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens,
            "ttft_s": result.ttft_s,
            "ttft_nocache_s": ttft_nocache,
            "identical": ref == result.output_token_ids,
        }

    rows = []
    with Engine(model, CacheConfig(device="cpu", device_blocks=2048)) as engine:
        ids, output = chat_ids(CHAT_TURNS[0]), []
        for turn, question in enumerate(CHAT_TURNS):
            if turn:  # the history is tokens, so turn k+1 can hit turn k's generated tokens
                follow = f"{END_OF_TURN}\nuser: {question}{END_OF_TURN}\nassistant: "
                ids = ids + output + tok(follow, add_special_tokens=False)["input_ids"]
            result = engine.generate([ids], params)[0]
            output = result.output_token_ids
            rows.append(compare(f"chat turn {turn + 1}", ids, result))
        batch = [chat_ids(q) for q in BATCH_QUESTIONS]
        for i, (ids, result) in enumerate(zip(batch, engine.generate(batch, params), strict=True)):
            rows.append(compare(f"batch {i + 1}", ids, result))
    return rows


def _print_demo_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvstore demo: tiny model, device tier")
    for col in ("request", "prompt", "cached", "TTFT ms", "no-cache ms", "speedup", "same"):
        table.add_column(col, justify="right")
    for row in report["requests"]:
        table.add_row(
            row["name"],
            str(row["prompt_tokens"]),
            str(row["cached_tokens"]),
            f"{row['ttft_s'] * 1e3:.1f}",
            f"{row['ttft_nocache_s'] * 1e3:.1f}",
            f"{row['ttft_nocache_s'] / row['ttft_s']:.1f}x",
            "yes" if row["identical"] else "NO",
        )
    console = Console()
    console.print(table)
    console.print(f"all identical: {report['all_identical']}  runtime {report['runtime_s']:.1f} s")


# --- entry point ----------------------------------------------------------------------------


def _user_errors() -> tuple[type[Exception], ...]:
    from engine.engine import InvalidRequestError
    from engine.model import ModelLoadError, UnsupportedModelError

    return (ConfigError, InvalidRequestError, ModelLoadError, UnsupportedModelError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="prefix-caching KV store")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, cmd in COMMANDS.items():
        cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except _user_errors() as e:  # typed user errors: say what to fix, no traceback
        print(f"kvstore {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
