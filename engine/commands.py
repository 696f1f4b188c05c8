"""The command registry and the flags every `kvstore` subcommand shares.

Subcommands register with `@command(name, help, add_arguments)`; cache flags are derived from
`CacheConfig` fields (`--block-size` -> block_size, ...) by kvstore.config.settings (flags over
KVSTORE_* env over TOML).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from kvstore.config import CacheConfig
from kvstore.config.settings import config_from_args

if TYPE_CHECKING:
    import torch

    from engine.model.loading import LoadedModel
    from kvstore.fleet.events import EventSink


class Command(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    requires: tuple[str, ...] = ()  # optional modules (engine.extras), checked before `run`


COMMANDS: dict[str, Command] = {}
ENGINE_MODULES = ("transformers",)  # what loading a model needs: the `engine` extra
# The --model of `generate`, `demo`, `stats` and `clear`: the real model (tiny's text is
# noise). `serve` and `router` default to tiny, the model of the tests and of `bench ttft`.
DEFAULT_MODEL = "smollm2"


class UsageError(ValueError):
    """A command's own arguments are wrong (checked before any model loads)."""


def command(
    name: str,
    help: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    requires: tuple[str, ...] = (),
):
    """Register `run(args) -> exit code` as subcommand `name`; `requires` lists the optional
    modules it needs (a missing one is reported with its extra before `run` starts)."""

    def register(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = Command(help, add_arguments, run, requires)
        return run

    return register


def int_at_least(text: str, least: int, what: str) -> int:
    """An argparse type's check: `text` as an int >= `least` (`what` names the bound)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: flag values are checked before any model loads."""
    return int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An argparse type: an int >= 0."""
    return int_at_least(text, 0, "an integer >= 0")


def add_model_flag(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--model",
        default=default,
        help="smollm2 (SmolLM2-135M-Instruct, fetched and converted once), tiny (random "
        "weights: its text is noise), dummy:NAME (a real model's shape with seeded random "
        "weights: smollm2-135m, llama-3.2-1b, llama-3.1-8b, qwen2.5-0.5b; docs/MODELS.md), a "
        f".gguf file or a local model directory (default: {default})",
    )


def threads_flag(text: str) -> int | None:
    """An argparse type: "auto" (None) or a thread count."""
    if text == "auto":
        return None
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        why = f"must be auto or a positive integer, got {text!r}"
        raise argparse.ArgumentTypeError(why) from None


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=threads_flag,
        default=None,
        metavar="auto|N",
        help="threads of the model's work on a CPU: auto (default) runs torch's count "
        "(OMP_NUM_THREADS) and sizes it down to the cores other processes leave free; N runs "
        'exactly N (docs/CONFIG.md, "Threads")',
    )


def thread_config(args: argparse.Namespace):
    """The engine's `ThreadConfig` from --threads."""
    from engine.loop.threads import ThreadConfig

    threads = getattr(args, "threads", None)
    return ThreadConfig(threads=threads, adapt=threads is None)


def check_model_flag(name: str, weights: bool = True) -> None:
    """`ModelLoadError` naming --model, before torch loads (seconds), unless `name` is one
    a loader takes: tiny, a built-in, `dummy:NAME`, an existing .gguf file, or a directory with
    config.json, tokenizer files and (`weights`; the router reads only the tokenizer) weights."""
    from engine.model.dummy import dummy_shape
    from engine.model.files import ModelLoadError, check_model_path
    from engine.model.gguf import BUILTINS
    from engine.model.tokenizer import TINY_NAME

    try:
        if dummy_shape(name) is not None:
            return
    except ModelLoadError as e:
        raise ModelLoadError(f"--model {e}") from None
    check_model_path(name, "--model", (TINY_NAME, *BUILTINS, "dummy:NAME"), weights)


def add_model_arguments(parser: argparse.ArgumentParser, default: str = DEFAULT_MODEL) -> None:
    add_model_flag(parser, default)
    add_threads_flag(parser)
    parser.add_argument(
        "--dtype",
        default="auto",
        help="float32, float16 or bfloat16; auto (default): float32, and a dummy:NAME model's "
        "bfloat16 on a GPU",
    )
    parser.add_argument(
        "--model-revision",
        default=None,
        help="pin the fingerprint to this string instead of hashing weights",
    )
    parser.add_argument(
        "--max-num-seqs", type=positive_int, default=32, help="requests running at once (batched)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="tokens fed per step over all requests (prefill chunks + decodes); "
        "default 256 on a CPU, 2048 on an accelerator",
    )
    parser.add_argument(
        "--prompt-logprob-blocks",
        type=non_negative_int,
        default=None,
        help="blocks whose prompt logprobs the engine keeps, so that a request asking for "
        "prompt logprobs (echo with logprobs) can use the cached K/V of a prefix whose blocks "
        "have them; 0 keeps none (default 4096, about 4 KB each at 16 tokens a block)",
    )
    parser.add_argument(
        "--linear-kernel",
        choices=("auto", "onednn", "dense"),
        default="auto",
        help="the model's linear layers in engine steps: onednn (weights packed once, every "
        "core on a product of few rows; a second copy of the weights in memory), dense "
        "(torch's own), auto (onednn on a CPU in float32, or bfloat16 where the CPU has its "
        "instructions, unless the linears are too small to pay its call; else dense)",
    )
    parser.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="decode steps replayed from graphs captured per batch size (CUDA graphs on a "
        "GPU, TorchScript traces on a CPU with dense linears): auto uses them where the "
        "model allows, on makes a model that cannot an error, off runs every step eager",
    )
    parser.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="launch each step before the previous step's greedy tokens reach the host "
        "(they are fed from the device and delivered a step late); auto: on a GPU",
    )


def check_cache_config(config: CacheConfig) -> torch.device:
    """The pool's device, once the settings that would fail after the model loaded are
    checked: the device exists, the LMDB directory is usable (`ConfigError` otherwise)."""
    from kvstore.device.pool import resolve_device
    from kvstore.stores import check_local_tiers

    device = resolve_device(config.device)
    check_local_tiers(config)
    return device


def quiet_load_model(
    name: str, device: object, dtype: str = "auto", revision: str | None = None
) -> LoadedModel:
    """`load_model` without transformers' progress bars (they would cut through ours)."""
    from transformers.utils import logging as hf_logging

    from engine.model.loading import load_model

    hf_logging.disable_progress_bar()
    return load_model(name, dtype, device, revision)


def load_engine(
    args: argparse.Namespace, events: EventSink | None = None, **cache_defaults: object
):
    """(LoadedModel, Engine) from model and cache flags; the model goes on the cache device;
    `events` gets the cache's block events."""
    from engine.loop.engine import Engine
    from engine.loop.graph import GraphConfig
    from engine.loop.scheduler_config import SchedulerConfig
    from engine.model.linear import LinearConfig

    config = config_from_args(args, **cache_defaults)
    device = check_cache_config(config)
    model = quiet_load_model(args.model, device, args.dtype, args.model_revision)
    overlap = {"auto": None, "on": True, "off": False}[args.async_scheduling]
    steps = SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, overlap)
    linears = LinearConfig(args.linear_kernel)
    engine = Engine(
        model, config, scheduler_config=steps, events=events, linear_config=linears,
        prompt_logprob_blocks=args.prompt_logprob_blocks, thread_config=thread_config(args),
        graph_config=GraphConfig(args.cuda_graphs),
    )  # fmt: skip
    return model, engine
