"""The command registry and the flags every `kvstore` subcommand shares.

Subcommands register with `@command(name, help, add_arguments)`; cache flags are derived from
`CacheConfig` fields (`--block-size` -> block_size, ...) by kvstore.settings (flags over
KVSTORE_* env over TOML).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NamedTuple

from kvstore.settings import add_cache_args, config_from_args


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


add_cache_arguments = add_cache_args
cache_config_from_args = config_from_args


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' or a local model directory")
    parser.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16")
    parser.add_argument(
        "--model-revision",
        default=None,
        help="pin the fingerprint to this string instead of hashing weights",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=32, help="requests running at once (batched)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="tokens fed per step over all requests (prefill chunks + decodes)",
    )


def load_engine(args: argparse.Namespace, **cache_defaults: object):
    """(LoadedModel, Engine) from model and cache flags; the model goes on the cache device."""
    from transformers.utils import logging as hf_logging

    from engine.engine import Engine
    from engine.model import load_model
    from engine.scheduler import SchedulerConfig
    from kvstore.pool import resolve_device

    hf_logging.disable_progress_bar()
    config = cache_config_from_args(args, **cache_defaults)
    model = load_model(args.model, args.dtype, resolve_device(config.device), args.model_revision)
    steps = SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs)
    return model, Engine(model, config, scheduler_config=steps)
