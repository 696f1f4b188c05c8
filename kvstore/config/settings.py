"""Build a CacheConfig from a TOML file, KVSTORE_* environment variables and CLI flags.

Precedence, lowest first: defaults < TOML file (`[cache]` table or top level) < environment
(`KVSTORE_<FIELD>`, e.g. KVSTORE_REDIS_URL) < command-line flags (`--<field-with-dashes>`).
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvstore.config import CacheConfig, ConfigError
from kvstore.config.help import FIELD_HELP, flag_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_PREFIX = "KVSTORE_"
_HINTS = typing.get_type_hints(CacheConfig)


def _base_type(name: str) -> type:
    """int, float, str or bool for a field, unwrapping `X | None`."""
    hint = _HINTS[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _optional(name: str) -> bool:
    return type(None) in typing.get_args(_HINTS[name])


def _coerce(name: str, raw: Any) -> Any:
    """`raw` as the field's type; "" and "none" unset an optional field (a str field such as
    codec keeps them: `--codec none` is the codec named none)."""
    if raw is None or (_optional(name) and isinstance(raw, str) and raw.lower() in ("", "none")):
        return None
    kind = _base_type(name)
    try:
        if kind is bool:
            return raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes", "on")
        return raw if isinstance(raw, kind) and not isinstance(raw, bool) else kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(name, f"expected {kind.__name__}, got {raw!r}") from None


def from_toml(path: str | Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError("config", f"cannot read TOML file {path}: {e}") from None
    table = data.get("cache", data)
    unknown = set(table) - set(_HINTS)
    if unknown:
        raise ConfigError(sorted(unknown)[0], f"unknown setting in {path}")
    return {k: _coerce(k, v) for k, v in table.items()}


def from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out = {}
    for name in _HINTS:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            out[name] = _coerce(name, raw)
    return out


def load_config(
    toml_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> CacheConfig:
    """Merge the sources (see module doc) and validate; raises ConfigError naming the field.

    `defaults` (a command's own defaults) sit just above the dataclass defaults.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = dict(defaults or {})
    path = toml_path or env.get(ENV_PREFIX + "CONFIG")
    if path:
        values.update(from_toml(path))
    values.update(from_env(env))
    values.update({k: _coerce(k, v) for k, v in (overrides or {}).items() if v is not None})
    return CacheConfig(**values)


def add_cache_args(parser: argparse.ArgumentParser, only: Collection[str] | None = None) -> None:
    """One `--field-name` flag per CacheConfig field (default None = not given); `only`:
    the fields a command reads (it offers no flag it would ignore)."""
    group = parser.add_argument_group(
        "cache", "CacheConfig fields, also KVSTORE_<FIELD> and TOML keys (docs/CONFIG.md)"
    )
    group.add_argument(
        "--config",
        dest="cache_config_file",
        metavar="TOML",
        default=None,
        help="TOML file of cache settings (a [cache] table); flags and KVSTORE_* win over it",
    )
    for f in fields(CacheConfig):
        flag = flag_name(f.name)
        if flag is None or (only is not None and f.name not in only):
            continue
        kind = _base_type(f.name)
        meaning = FIELD_HELP[f.name].replace("`", "").replace("%", "%%")
        group.add_argument(
            flag,
            dest=f"cache_{f.name}",
            type=str if kind is bool else kind,
            default=None,
            metavar=kind.__name__.upper(),
            help=f"{meaning} (default: {'unset' if f.default is None else repr(f.default)})",
        )


def config_from_args(args: argparse.Namespace, **defaults: Any) -> CacheConfig:
    """CacheConfig from parsed `add_cache_args` flags over env, TOML and `defaults`."""
    overrides = {
        f.name: getattr(args, f"cache_{f.name}")
        for f in fields(CacheConfig)
        if getattr(args, f"cache_{f.name}", None) is not None
    }
    return load_config(
        getattr(args, "cache_config_file", None), overrides=overrides, defaults=defaults
    )
