"""`bench kvquant`'s device pool half: each `--kv-cache-dtypes` pool against `auto` in the
same run, on the engine's own paged path (every attention read of the prompt and of each
decode step dequantizes the pool):

- perplexity of the fixed text from one prefill's prompt logprobs;
- the demo's prompts: 32-token greedy continuations identical to `auto`'s, meeting the
  output contract at the pool codec's tolerance against no cache, and a hit of each (its
  prompt again, now cached) identical to the miss that wrote it;
- max |Δlogit| of each prompt's last position against `auto`;
- the pool's blocks at the same `device_cache_gb`, against `auto`'s.
"""

from __future__ import annotations

import dataclasses
import math

from kvstore.config import CODEC_TOLERANCE, POOL_CODECS, CacheConfig
from kvstore.device.pool import pool_blocks

CAPACITY_GB = 1.0  # the pool size the blocks are counted at


def pool_config(kv_cache_dtype: str) -> CacheConfig:
    return CacheConfig(block_size=16, device="cpu", device_blocks=1024,
                       kv_cache_dtype=kv_cache_dtype)  # fmt: skip


def text_perplexity(engine, ids: list[int]) -> float:
    """exp(mean NLL) of tokens 1.. of `ids` from one uncached prefill's prompt logprobs."""
    from engine.loop.engine import SamplingParams

    result = engine.generate([ids], SamplingParams(max_new_tokens=1, prompt_logprobs=1))[0]
    logprobs = [lp for lp in result.prompt_logprobs.logprobs if lp is not None]
    return math.exp(-sum(logprobs) / len(logprobs))


def measure(lm, kv_cache_dtype: str, ids: list[int], prompts: list[list[int]], tokens: int):
    """One pool's figures: ppl, each prompt's continuation as a miss and as a hit, and each
    prompt's last-position logits (float32)."""
    from engine.contract import FP32_TOL, count_meeting_contract
    from engine.loop.engine import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=tokens)
    codec = POOL_CODECS.get(kv_cache_dtype, "none")
    tol = max(FP32_TOL, CODEC_TOLERANCE[codec])
    with Engine(lm, pool_config(kv_cache_dtype)) as engine:
        ppl = text_perplexity(engine, ids)
        engine.on_loop(engine.cache.evict_device)
        misses = [engine.generate([p], params)[0].output_token_ids for p in prompts]
        hits = [engine.generate([p], params)[0].output_token_ids for p in prompts]
        engine.on_loop(engine.cache.evict_device)
        logits = [engine.prefill_logits(p)[0] for p in prompts]
        meets = engine.on_loop(lambda: count_meeting_contract(lm, prompts, misses, tol=tol))
    return ppl, misses, hits, logits, meets


def pool_rows(lm, dtypes: list[str], ids: list[int], prompts: list[list[int]], tokens: int):
    """A row per pool dtype, each against `auto`'s figures of the same run."""
    auto = measure(lm, "auto", ids, prompts, tokens)
    blocks = {d: capacity(lm, d) for d in {"auto", *dtypes}}
    rows = []
    for dtype in dtypes:
        ppl, misses, hits, logits, meets = auto if dtype == "auto" else measure(
            lm, dtype, ids, prompts, tokens)  # fmt: skip
        worst = max(float((a - b).abs().max()) for a, b in zip(logits, auto[3], strict=True))
        rows.append({
            "kv_cache_dtype": dtype, "ppl": ppl, "ppl_auto": auto[0],
            "ppl_change": ppl / auto[0] - 1, "max_logit_change": worst,
            "identical_to_auto": sum(m == a for m, a in zip(misses, auto[1], strict=True)),
            "hit_equals_miss": sum(h == m for h, m in zip(hits, misses, strict=True)),
            "meet_contract": meets,
            "prompts": len(prompts), "blocks": blocks[dtype],
            "blocks_vs_auto": blocks[dtype] / blocks["auto"],
        })  # fmt: skip
    return rows


def capacity(lm, kv_cache_dtype: str) -> int:
    """The blocks a pool of CAPACITY_GB holds for `lm`'s KV."""
    config = CacheConfig(device_cache_gb=CAPACITY_GB, kv_cache_dtype=kv_cache_dtype)
    namespace = dataclasses.replace(lm.namespace(16), kv_cache_dtype=kv_cache_dtype)
    return pool_blocks(config, namespace)


def print_pool_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = report.get("pools") or []
    if not rows:
        return
    table = Table(title=f"quantized device pools on {report['model']}, each against auto: "
                  f"perplexity, {report['max_tokens']}-token greedy continuations, blocks in "
                  f"{CAPACITY_GB:g} GiB")  # fmt: skip
    for col in ("kv_cache_dtype", "ppl", "ppl auto", "change", "max |Δlogit|",
                "as auto", "meet contract", "hit = miss", "blocks", "÷ auto"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        n = r["prompts"]
        table.add_row(r["kv_cache_dtype"], f"{r['ppl']:.4f}", f"{r['ppl_auto']:.4f}",
                      f"{r['ppl_change']:+.2%}", f"{r['max_logit_change']:.3g}",
                      f"{r['identical_to_auto']}/{n}", f"{r['meet_contract']}/{n}",
                      f"{r['hit_equals_miss']}/{n}",
                      str(r["blocks"]), f"{r['blocks_vs_auto']:.2f}")  # fmt: skip
    Console().print(table)
