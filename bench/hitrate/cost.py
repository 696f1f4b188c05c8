"""A linear cost model that turns a replay's hits into an estimated time to first token.

A request's TTFT is estimated as the prefill of its uncached tokens plus the load of each
hit block from the tier that served it:

    ttft = prefill_ms_per_token * (prompt tokens - hit blocks * block tokens)
           + sum over tiers of load_ms_per_block[tier] * blocks that tier served

and `est_ttft_s` is its mean over the requests; `est_ttft_nocache_s` is the mean prefill of
every prompt token. Prefill is taken as linear in tokens (attention's quadratic term and the
decode of the first token are left out), and loads as independent of what else runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CostModel", "parse_assignments"]


def parse_assignments(text: str, flag: str) -> dict[str, str]:
    """ "a=1,b=2" -> {"a": "1", "b": "2"}; `flag` names the option in error messages."""
    out: dict[str, str] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise ValueError(f"{flag} expects TIER=VALUE items separated by commas, got {item!r}")
        if name in out:
            raise ValueError(f"{flag} names tier {name!r} twice")
        out[name] = value
    if not out:
        raise ValueError(f"{flag} expects TIER=VALUE items separated by commas, got {text!r}")
    return out


def _non_negative(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class CostModel:
    """Prefill cost per prompt token and load cost per block of each tier, in ms."""

    prefill_ms_per_token: float
    load_ms_per_block: tuple[tuple[str, float], ...]

    def __post_init__(self) -> None:
        _non_negative(self.prefill_ms_per_token, "--prefill-ms-per-token")
        for tier, ms in self.load_ms_per_block:
            _non_negative(ms, f"--load-ms-per-block {tier}")

    @classmethod
    def parse(cls, prefill_ms_per_token: float, loads: str, tiers: tuple[str, ...]) -> CostModel:
        """From the flags' values; `tiers` are the names a load cost may be given for."""
        given = parse_assignments(loads, "--load-ms-per-block")
        unknown = sorted(set(given) - set(tiers))
        if unknown:
            raise ValueError(f"--load-ms-per-block: unknown tier(s) {unknown}; tiers are {tiers}")
        try:
            pairs = tuple((tier, float(ms)) for tier, ms in given.items())
        except ValueError:
            raise ValueError(f"--load-ms-per-block values must be numbers, got {loads!r}") from None
        return cls(prefill_ms_per_token, pairs)

    def check_covers(self, tiers: tuple[str, ...]) -> None:
        """Every tier a replay uses needs a load cost."""
        missing = [t for t in tiers if t not in dict(self.load_ms_per_block)]
        if missing:
            items = ",".join(f"{t}=MS" for t in missing)
            raise ValueError(f"--load-ms-per-block has no cost for {missing}: add {items}")

    def mean_ttft_s(
        self, tier_block_hits: dict[str, int], total_tokens: int, requests: int, block_tokens: int
    ) -> float:
        """Mean estimated TTFT over the requests, in seconds."""
        if requests == 0:
            return 0.0
        loads = dict(self.load_ms_per_block)
        hit_blocks = sum(tier_block_hits.values())
        prefill = self.prefill_ms_per_token * (total_tokens - hit_blocks * block_tokens)
        load = sum(loads[tier] * n for tier, n in tier_block_hits.items())
        return (prefill + load) / requests / 1000.0

    def mean_nocache_s(self, total_tokens: int, requests: int) -> float:
        """Mean prefill of every prompt token, in seconds."""
        return self.prefill_ms_per_token * total_tokens / requests / 1000.0 if requests else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "prefill_ms_per_token": self.prefill_ms_per_token,
            "load_ms_per_block": dict(self.load_ms_per_block),
        }
