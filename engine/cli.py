"""`kvstore` command line: generate, demo, serve here; stats and clear in engine/admin.py.

Cache flags are derived from `CacheConfig` fields (`--block-size` -> block_size, ...), so
every subcommand that builds a cache shares them via `kvstore.config.settings.add_cache_args`.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import sys
import time
from typing import NoReturn

from engine.commands import (  # noqa: F401  (re-exported for callers of the CLI)
    COMMANDS,
    DEFAULT_MODEL,
    ENGINE_MODULES,
    Command,
    UsageError,
    add_model_arguments,
    add_model_flag,
    add_threads_flag,
    check_cache_config,
    check_model_flag,
    command,
    load_engine,
    positive_int,
    quiet_load_model,
    thread_config,
)
from engine.extras import as_missing_extra, require
from kvstore.config import ConfigError
from kvstore.config.settings import add_cache_args, config_from_args

# Modules whose typed errors mean "fix the input" (exit 2 with their message).
USER_ERRORS = {
    "engine.commands": ("UsageError",),
    "engine.loop.request": ("InvalidRequestError",),
    "engine.model.files": ("ModelLoadError",),
    "engine.model.loading": ("UnsupportedModelError",),
    "engine.model.linear": ("LinearKernelError",),
}

# --- generate -------------------------------------------------------------------------------


def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt",
        help="the question: sent as one user message through the model's chat template "
        "(a model without one takes the text as it is)",
    )
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3 (as they are)")
    parser.add_argument("--system", default=None, help="a system message before the prompt")
    parser.add_argument(
        "--raw", action="store_true", help="send the --prompt text as it is, no chat template"
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=16,
        help="most tokens to generate (fewer if EOS or a stop string comes first)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate past EOS")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_cache_args(parser)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated ints, got {text!r}") from None
    if not ids:
        raise UsageError("--prompt-ids is empty; give at least one token id")
    return ids


def _check_prompt(args: argparse.Namespace) -> None:
    """The prompt flags, before any model loads: usage errors come in a second."""
    if args.prompt is not None and not args.prompt:
        raise UsageError("--prompt is empty; give the question's text")
    if args.system is not None and (args.raw or args.prompt is None):
        raise UsageError("--system goes with --prompt through the chat template "
                         "(not with --raw or --prompt-ids)")  # fmt: skip
    if args.prompt_ids is not None:
        args.prompt_ids = _parse_ids(args.prompt_ids)


def _rendered(args: argparse.Namespace, tokenizer: object) -> tuple[list[int] | str, str]:
    """The prompt the engine gets, and how it was made: `chat` (the user message through
    the template) or `raw` (--raw, --prompt-ids, or a model without a template: said on
    stderr)."""
    from engine.loop.prompt import chat_prompt_ids

    if args.prompt is None:
        return args.prompt_ids, "raw"
    if args.raw:
        return args.prompt, "raw"
    ids = chat_prompt_ids(tokenizer, args.prompt, args.system)
    if ids is not None:
        return ids, "chat"
    if args.system is not None:
        raise UsageError("--system: the model has no chat template to put it in")
    print("note: the model has no chat template: the prompt goes as it is", file=sys.stderr)
    return args.prompt, "raw"


@command(
    "generate",
    f"answer one prompt (through the model's chat template) with --model (default "
    f"{DEFAULT_MODEL}, SmolLM2-135M-Instruct; --model tiny loads faster, but its random "
    "weights make noise)",
    _generate_arguments,
    requires=ENGINE_MODULES,
)
def run_generate(args: argparse.Namespace) -> int:
    check_model_flag(args.model)  # before torch loads: a bad path fails in a second
    _check_prompt(args)
    from engine.loop.engine import SamplingParams

    params = SamplingParams(
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    model, engine = load_engine(args)
    with engine:
        prompt, how = _rendered(args, model.tokenizer)
        result = engine.generate([prompt], params)[0]
    out = {
        "prompt": how,
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
        short = _short_prompt_note(result.prompt_tokens, engine.cache_config.block_size)
        if short is not None:
            print(short)
    return 0


def _short_prompt_note(prompt_tokens: int, block_size: int) -> str | None:
    """Why a repeat of a prompt shorter than one block can never hit the cache."""
    if prompt_tokens >= block_size:
        return None
    return (
        f"note: the prompt has {prompt_tokens} tokens, fewer than one cache block "
        f"({block_size}): a repeat of it cannot hit the cache, since hits are whole blocks "
        "(--block-size sets their size)"
    )


# --- demo -----------------------------------------------------------------------------------


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_flag(parser, default=DEFAULT_MODEL)
    add_threads_flag(parser)
    parser.add_argument(
        "--max-tokens", type=positive_int, default=24, help="most tokens each answer generates"
    )
    add_cache_args(parser)


@command(
    "demo",
    "a 4-turn chat and 4 questions sharing a system prompt on SmolLM2-135M-Instruct, each "
    "checked against a no-cache run",
    _demo_arguments,
    requires=ENGINE_MODULES,
)
def run_demo(args: argparse.Namespace) -> int:
    check_model_flag(args.model)
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from engine.demo import demo_header, num_requests, print_demo_table, run_demo_requests

    start = time.perf_counter()
    config = config_from_args(args, device_blocks=2048)
    device = check_cache_config(config)
    print(f"kvstore demo: {demo_header(args.model, config, device)}", file=sys.stderr)
    model = quiet_load_model(args.model, device)
    with (
        tqdm(total=num_requests(config), desc="requests", unit="req", file=sys.stderr) as bar,
        logging_redirect_tqdm(),
    ):
        rows = run_demo_requests(
            model, args.max_tokens, config, lambda _: bar.update(), thread_config(args)
        )
    report = {
        "model": args.model,
        "requests": rows,
        "all_identical": all(r["identical"] for r in rows),
        "runtime_s": time.perf_counter() - start,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print_demo_table(report, args.model, config, device)
    return 0 if report["all_identical"] else 1


# --- serve ----------------------------------------------------------------------------------


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.server.config import add_server_arguments

    add_model_arguments(parser, default="tiny")
    add_server_arguments(parser)
    add_cache_args(parser)


@command(
    "serve",
    "OpenAI- and Anthropic-compatible HTTP server (/v1/completions, /v1/chat/completions, "
    "/v1/messages) with /metrics and /health",
    _serve_arguments,
    requires=(*ENGINE_MODULES, "fastapi", "uvicorn"),
)
def run_serve(args: argparse.Namespace) -> int:
    from engine.server.config import check_ports_free, server_config_from_args

    config = server_config_from_args(args)  # flags, ports and model first: before torch loads
    check_ports_free(config)
    check_model_flag(args.model)
    from engine.server.app import run_server

    return run_server(args)


# --- entry point ----------------------------------------------------------------------------


def _user_errors() -> tuple[type[Exception], ...]:
    """Typed errors that mean "fix the input"; a module never imported raised none of its."""
    errors: list[type[Exception]] = [ConfigError]
    for module, names in USER_ERRORS.items():
        if module in sys.modules:
            errors += [getattr(sys.modules[module], name) for name in names]
    return tuple(errors)


class _Parser(argparse.ArgumentParser):
    """One line per error, not the usage: an unknown flag is named first (with the closest
    known one), before a missing required argument would hide it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if self._subparsers is None:  # a subcommand's own flags
            self._check_flags(sys.argv[1:] if args is None else list(args))
        return super().parse_known_args(args, namespace)

    def _check_flags(self, args: list[str]) -> None:
        known = set(self._option_string_actions)
        for arg in args:
            flag = arg.split("=", 1)[0]
            if flag.startswith("--") and flag != "--" and flag not in known:
                close = difflib.get_close_matches(flag, sorted(known), n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                self.error(f"unknown flag {flag}{hint}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvstore", description="prefix-caching KV store")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, cmd in COMMANDS.items():
        cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


class _StderrFormatter(logging.Formatter):
    """`kvstore <command>: warning: <message>`, like the command's own error lines."""

    def __init__(self, command: str):
        super().__init__()
        self.command = command

    def format(self, record: logging.LogRecord) -> str:
        text = f"kvstore {self.command}: {record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def log_to_stderr(command: str, level: int | str = logging.WARNING) -> None:
    """Show the `kvstore.*` loggers (tier warnings, server start-up) on stderr."""
    logger = logging.getLogger("kvstore")
    for handler in [h for h in logger.handlers if getattr(h, "kvstore_cli", False)]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.kvstore_cli = True  # type: ignore[attr-defined]
    handler.setFormatter(_StderrFormatter(command))
    logger.addHandler(handler)
    logger.setLevel(level)


def _fail(command: str, error: BaseException) -> int:
    """One line on stderr (what to fix), exit status 2."""
    print(f"kvstore {command}: error: {' '.join(str(error).split())}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cmd = COMMANDS[args.command]
    log_to_stderr(args.command, getattr(args, "log_level", "warning").upper())
    try:
        require(*cmd.requires)
        return cmd.run(args)
    except ImportError as e:  # an extra that is not installed: say which
        missing = as_missing_extra(e)
        if missing is None:
            raise
        return _fail(args.command, missing)
    except Exception as e:
        if not isinstance(e, _user_errors()):
            raise
        return _fail(args.command, e)


def _register_more() -> None:
    """Commands defined in their own modules register on import."""
    import engine.admin
    import engine.router.command  # noqa: F401


_register_more()

if __name__ == "__main__":
    sys.exit(main())
