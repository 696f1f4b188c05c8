"""ServerConfig: the HTTP server's own settings (the cache's are `CacheConfig`), and its flags.

This module imports only the standard library, so `kvstore --help` stays fast.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engine.api.keys import (
    API_KEY_ENV,
    DEFAULT_TENANT,
    api_keys_from_args,
    check_api_key,
    check_tenant,
)
from engine.api.roles import ROLES
from kvstore.config import ConfigError


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, f"must be an int >= {minimum}, got {value!r}")


def check_port_free(host: str, port: int, name: str = "port") -> None:
    """ConfigError (naming the field `name`) now if the port is taken: not after the model
    loaded and the server said it started."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ConfigError(name, f"cannot listen on {host}:{port}: {e.strerror}") from None


def check_ports_free(config: ServerConfig) -> None:
    """The HTTP port and, with KV events, the events and replay ports: each free now."""
    for name, port in config.ports().items():
        check_port_free(config.host, port, name)


def flag_of(name: str) -> str:
    """The command-line flag of a ServerConfig field: kv_events_port -> --kv-events-port."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class ServerConfig:
    """Settings of `kvstore serve`. `api_keys` maps an API key to its tenant; empty = no auth."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "tiny"
    api_keys: Mapping[str, str] = field(default_factory=dict, repr=False)  # secrets
    metrics_require_key: bool = False
    max_queue: int = 256  # requests waiting (not running) over all tenants
    max_body_bytes: int = 4 << 20
    max_prompt_tokens: int | None = None  # None: only the model's positions bound it
    max_tokens_limit: int = 2048  # largest max_tokens a request may ask for
    max_n: int = 16  # largest n (and best_of) a request may ask for
    retry_after_s: int = 1  # Retry-After of a 429
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    log_level: str = "info"
    kv_events_port: int | None = None  # ZMQ PUB of the index's events (None: not published)
    # ZMQ ROUTER answering replays; None with kv_events_port: kv_events_port + 1
    kv_events_replay_port: int | None = None
    # "prefill": hands each answered prompt over to the shared tier before answering;
    # "decode": takes hand-overs; "both": neither (a router pairs the first two)
    role: str = "both"

    def __post_init__(self) -> None:
        _check_int("port", self.port, 0)
        if self.port > 65535:
            raise ConfigError("port", f"must be <= 65535, got {self.port}")
        if not self.served_model_name:
            raise ConfigError("served_model_name", "must not be empty")
        for key, tenant in self.api_keys.items():
            check_api_key(key)
            check_tenant(tenant)
        if self.metrics_require_key and not self.api_keys:
            raise ConfigError("metrics_require_key", "needs --api-key or --api-keys-file")
        _check_int("max_queue", self.max_queue, 1)
        _check_int("max_body_bytes", self.max_body_bytes, 1024)
        if self.max_prompt_tokens is not None:
            _check_int("max_prompt_tokens", self.max_prompt_tokens, 1)
        _check_int("max_tokens_limit", self.max_tokens_limit, 1)
        _check_int("max_n", self.max_n, 1)
        _check_int("retry_after_s", self.retry_after_s, 1)
        drain = self.drain_timeout_s
        if isinstance(drain, bool) or not isinstance(drain, int | float) or not 0 <= drain <= 3600:
            raise ConfigError("drain_timeout_s", f"must be 0..3600 seconds, got {drain!r}")
        if self.role not in ROLES:
            raise ConfigError("role", f"choose from {', '.join(ROLES)}, got {self.role!r}")
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            raise ConfigError("log_level", f"unknown level {self.log_level!r}")
        self._check_events()

    def _check_events(self) -> None:
        if self.kv_events_port is None:
            if self.kv_events_replay_port is not None:
                raise ConfigError("kv_events_replay_port", "needs --kv-events-port")
            return
        _check_int("kv_events_port", self.kv_events_port, 1)
        if self.kv_events_replay_port is None:  # the default
            object.__setattr__(self, "kv_events_replay_port", self.kv_events_port + 1)
        for name in ("kv_events_port", "kv_events_replay_port"):
            _check_int(name, getattr(self, name), 1)
            if getattr(self, name) > 65535:
                raise ConfigError(name, f"must be <= 65535, got {getattr(self, name)}")
        self._check_distinct()

    def _check_distinct(self) -> None:
        """Each of the three ports its own: a clash names both flags and the port."""
        for first, second in itertools.combinations(self.ports().items(), 2):
            if first[1] == second[1]:
                raise ConfigError(
                    second[0],
                    f"{flag_of(second[0])} {second[1]} equals {flag_of(first[0])} {first[1]}; "
                    "give --port, --kv-events-port and --kv-events-replay-port a port each "
                    "(--kv-events-replay-port defaults to --kv-events-port + 1)",
                )

    def ports(self) -> dict[str, int]:
        """The ports it listens on, by field: HTTP, and the KV events' when published."""
        ports = {"port": self.port}
        if self.kv_events_port is not None:
            ports["kv_events_port"] = self.kv_events_port
            ports["kv_events_replay_port"] = self.kv_events_replay_port
        return ports

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0: all)")
    group.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    group.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients must send (default: the --model name)",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help=f"the one API key, tenant {DEFAULT_TENANT!r} (default: ${API_KEY_ENV})",
    )
    group.add_argument(
        "--api-keys-file", default=None, help='JSON {"key": "tenant", ...}; one tenant per name'
    )
    group.add_argument(
        "--metrics-require-key", action="store_true", help="/metrics needs a valid key too"
    )
    group.add_argument("--max-queue", type=int, default=256, help="waiting requests; then 429")
    group.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger: 413")
    group.add_argument("--max-prompt-tokens", type=int, default=None, help="longer prompts: 400")
    group.add_argument("--max-tokens-limit", type=int, default=2048, help="largest max_tokens")
    group.add_argument(
        "--max-n", type=int, default=16, help="largest n and best_of (sequences per request)"
    )
    group.add_argument("--retry-after-s", type=int, default=1, help="Retry-After of a 429")
    group.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM, new requests get 503 and in-flight ones this long to finish (default 30)",
    )
    group.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        help="publish the cache's block events (vLLM's KV event format, ZMQ PUB) on this port",
    )
    group.add_argument(
        "--kv-events-replay-port",
        type=int,
        default=None,
        help="the replay socket (ZMQ ROUTER) for subscribers that start late or missed "
        "batches (default: --kv-events-port + 1)",
    )
    group.add_argument(
        "--role",
        default="both",
        choices=ROLES,
        help="prefill: write each prompt's blocks to the shared tier before answering; "
        "decode: take requests whose prompt a prefill replica handed over; both (default): "
        "serve whole requests. A router pairs prefill and decode replicas (docs/DEPLOY.md)",
    )
    group.add_argument(
        "--log-level",
        default="info",
        help="critical, error, warning, info or debug: uvicorn's and kvstore's messages",
    )


def server_config_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> ServerConfig:
    env = os.environ if env is None else env
    keys = api_keys_from_args(args, env)
    name = args.served_model_name or Path(args.model.rstrip("/")).name or args.model
    return ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=name,
        api_keys=keys,
        metrics_require_key=args.metrics_require_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_n=args.max_n,
        retry_after_s=args.retry_after_s,
        drain_timeout_s=args.drain_timeout_s,
        log_level=args.log_level,
        kv_events_port=args.kv_events_port,
        kv_events_replay_port=args.kv_events_replay_port,
        role=args.role,
    )


def check_role(config: ServerConfig, shared_tier: bool) -> None:
    """A prefill or decode replica hands KV over through a tier other processes read."""
    if config.role != "both" and not shared_tier:
        raise ConfigError(
            "role",
            f"--role {config.role} hands KV over through a shared tier: give --redis-url "
            "(or --lmdb-dir, on one host) the same on the prefill and the decode replicas",
        )
