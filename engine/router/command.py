"""`kvstore router`: flags first (a bad one fails in well under a second), then the
tokenizer of `--model` (the replicas' model: prompts are hashed as they hash them), then
the server."""

from __future__ import annotations

import argparse

from engine.commands import add_model_flag, check_model_flag, command
from engine.router.config import add_router_arguments, router_config_from_args
from engine.server.config import check_port_free


def _arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flag(parser, default="tiny")
    add_router_arguments(parser)


@command(
    "router",
    "one OpenAI- and Anthropic-compatible endpoint in front of `kvstore serve` replicas, "
    "routing by their KV events and load",
    _arguments,
    requires=("transformers", "fastapi", "uvicorn", "httpx", "zmq", "msgspec"),
)
def run_router(args: argparse.Namespace) -> int:
    config = router_config_from_args(args)  # flags, model and port first: before the tokenizer
    check_model_flag(args.model, weights=False)  # the router reads only its tokenizer
    check_port_free(config.host, config.port)
    import uvicorn

    from engine.model.tokenizer import load_tokenizer_of
    from engine.router.app import create_router_app

    tokenizer = load_tokenizer_of(args.model)
    app = create_router_app(config, tokenizer)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)
    return 0
