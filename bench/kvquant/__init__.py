"""`python -m bench kvquant`: what a quantized tier codec (int8, fp8) costs a real model.

For each codec (`--codecs`, default none,int8,fp8) on SmolLM2-135M-Instruct (`--model`),
against the same model without a cache, in one run:
- **perplexity** of a fixed text (bench/kvquant/text.py), scored in chunks of `--chunk`
  tokens, each chunk on top of the whole text before it read back from an LMDB tier through
  the codec (what a multi-turn chat reads back), against one no-cache forward of the text;
- **max |Δlogit|**: the largest change of any logit at any scored position;
- **greedy agreement**: the demo's prompts (its 4 chat turns, whose history holds the
  no-cache answers, and its 4 questions; the smollm2 chat test runs the first 3 turns) through
  the chat template; an engine whose device pool is emptied before each prompt reads the
  prompt's prefix from the tier through the codec and generates `--max-tokens` (32) greedy
  tokens, compared token for token with a no-cache greedy run; and whether each continuation
  meets the output contract with the codec's tolerance (every token the no-cache argmax of
  its own prefix wherever the top two logits are further apart than that tolerance);
- **closest calls**: for each prompt, the smallest gap between the two likeliest tokens in
  its no-cache continuation (a logit change under half of it cannot flip a token there).
Codec `none` is the control: the exact contract (perplexity equal, every continuation the
same). About 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile

import torch
from tqdm import tqdm

from bench.kvquant.pool import pool_rows, print_pool_table
from bench.kvquant.text import TEXT
from hashing import KV_CACHE_DTYPES
from kvstore.config import CODEC_NAMES, CODEC_TOLERANCE, CacheConfig

BLOCK_SIZE = 16


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench kvquant", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2, tiny, dummy:NAME, a .gguf file "
                   "or a model directory")  # fmt: skip
    p.add_argument("--codecs", default="none,int8,fp8", help="comma-separated tier codecs "
                   "(empty: none of them)")  # fmt: skip
    p.add_argument("--kv-cache-dtypes", default="auto,int8,fp8_e4m3", help="comma-separated "
                   "device pools, each against auto (empty: none of them)")  # fmt: skip
    p.add_argument("--chunk", type=int, default=128, help="tokens scored per chunk (whole blocks)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--prompts", type=int, default=None, help="the first N demo prompts (all 8)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    args.codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    for codec in args.codecs:
        if codec not in CODEC_NAMES:
            p.error(f"--codecs: unknown codec {codec!r}; choose from {','.join(CODEC_NAMES)}")
    args.kv_cache_dtypes = [d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()]
    for dtype in args.kv_cache_dtypes:
        if dtype not in KV_CACHE_DTYPES:
            p.error(
                f"--kv-cache-dtypes: unknown {dtype!r}; choose from {','.join(KV_CACHE_DTYPES)}"
            )
    if args.chunk <= 0 or args.chunk % BLOCK_SIZE:
        p.error(f"--chunk: a positive multiple of the block size ({BLOCK_SIZE})")
    if args.max_tokens <= 0:
        p.error("--max-tokens: a positive number of tokens")
    return args


def tier_config(codec: str, directory: str) -> CacheConfig:
    """A CPU pool with one LMDB tier written through, its entries in `codec`."""
    return CacheConfig(
        block_size=BLOCK_SIZE, device="cpu", device_blocks=512, lmdb_dir=directory,
        lmdb_write_policy="write-through", codec=codec,
    )  # fmt: skip


# --- perplexity ---------------------------------------------------------------------------


def text_kv(lm, ids: list[int]) -> tuple[torch.Tensor, list]:
    """One no-cache forward of the text: its logits [T, vocab] and per-layer (K, V)."""
    from engine.model.loading import kv_cache, with_cache

    past = kv_cache(lm.model.config)
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([ids]), **with_cache(lm.model, past))
    return out.logits[0].float(), [(layer.keys, layer.values) for layer in past.layers]


def chunk_logits(lm, ids: list[int], start: int, stop: int, layers: list) -> torch.Tensor:
    """Logits of positions [start, stop) on top of the prefix K/V `layers` (start tokens)."""
    from engine.model.loading import kv_cache, with_cache

    past = kv_cache(lm.model.config)
    for layer, (k, v) in zip(past.layers, layers, strict=True):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k.contiguous(), v.contiguous()
    with torch.inference_mode():
        out = lm.model(
            input_ids=torch.tensor([ids[start:stop]]),
            position_ids=torch.arange(start, stop).unsqueeze(0),
            **with_cache(lm.model, past),
        )
    return out.logits[0].float()


def nll(logits: torch.Tensor, targets: list[int]) -> float:
    """Summed negative log-likelihood of `targets` under `logits` [n, vocab]."""
    logp = torch.log_softmax(logits, dim=-1)
    return -float(logp[torch.arange(len(targets)), torch.tensor(targets)].sum())


def perplexity(lm, ids: list[int], codec: str, chunk: int, reference: torch.Tensor, kv) -> dict:
    """Chunks 1.. of the text, each on top of its prefix read back through `codec`."""
    from kvstore.cache import PrefixCache

    total = ref_total = 0.0
    scored, worst = 0, 0.0
    with (
        tempfile.TemporaryDirectory() as tmp,
        PrefixCache(tier_config(codec, tmp), lm.namespace(BLOCK_SIZE, codec=codec)) as cache,
    ):
        cache.store(ids, kv)
        cache.flush(60)
        for start in range(chunk, len(ids) - 1, chunk):
            cache.evict_device()  # the prefix comes from the tier, through the codec
            hit = cache.lookup(ids[: start + 1])
            if hit.tier_tokens != {"lmdb": start}:
                raise RuntimeError(f"{codec}: the tier gave {hit.tier_tokens}, not {start}")
            prefix = cache.load(hit)
            cache.release(hit)
            stop = min(start + chunk, len(ids) - 1)
            logits = chunk_logits(lm, ids, start, stop, prefix.layers)
            targets = ids[start + 1 : stop + 1]
            total += nll(logits, targets)
            ref_total += nll(reference[start:stop], targets)
            worst = max(worst, float((logits - reference[start:stop]).abs().max()))
            scored += len(targets)
    ppl, ref_ppl = math.exp(total / scored), math.exp(ref_total / scored)
    return {"ppl": ppl, "ppl_nocache": ref_ppl, "ppl_change": ppl / ref_ppl - 1,
            "max_logit_change": worst, "scored_tokens": scored}  # fmt: skip


# --- greedy agreement ---------------------------------------------------------------------


def demo_prompts(
    lm, max_tokens: int, limit: int | None
) -> tuple[list[list[int]], list, list[list[float]]]:
    """The demo's prompts through the chat template, each one's no-cache greedy tokens (run
    on an engine's loop thread, with its kernels; a chat turn's history holds them), and
    each one's `continuation_gaps`."""
    from engine.demo import BATCH_QUESTIONS, CHAT_TURNS, SYSTEM_PROMPT
    from engine.loop.engine import Engine
    from engine.loop.sequential import reference_generate

    tok, system = lm.tokenizer, {"role": "system", "content": SYSTEM_PROMPT}

    def ids(messages: list[dict]) -> list[int]:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    prompts, refs, gaps, history = [], [], [], [system]
    with Engine(lm, CacheConfig(block_size=BLOCK_SIZE, device="cpu")) as engine:
        turns = [(q, True) for q in CHAT_TURNS] + [(q, False) for q in BATCH_QUESTIONS]
        for question, chat in turns[:limit]:
            messages = [*history, {"role": "user", "content": question}] if chat else [
                system, {"role": "user", "content": question}]  # fmt: skip
            prompt = ids(messages)
            ref, _ = engine.on_loop(
                lambda p=prompt: reference_generate(lm, p, max_tokens, lm.eos_token_ids)
            )
            prompts.append(prompt)
            refs.append(ref)
            gaps.append(engine.on_loop(lambda p=prompt, r=ref: continuation_gaps(lm, p, r)))
            if chat:
                answer = tok.decode(ref, skip_special_tokens=True)
                history = [*messages, {"role": "assistant", "content": answer}]
    return prompts, refs, gaps


def continuation_gaps(lm, prompt: list[int], ref: list[int]) -> list[float]:
    """The no-cache top-two gap before each token of the continuation `ref` of `prompt`, and
    after its last (one forward): where a changed greedy token was, how near a tie."""
    return top2_gaps(lm, prompt + ref, len(prompt) - 1)


def closest_tie(gaps: list[float]) -> dict:
    """Where a continuation came nearest to a tie (`gaps` before each of its tokens): the
    token whose two likeliest candidates had the smallest logit gap, and that gap. A change
    of the logits smaller than half of it cannot change the greedy token there; a larger one
    may, whatever caused it."""
    at = min(range(len(gaps)), key=gaps.__getitem__)
    return {"token": at, "top2_gap": gaps[at]}


def agreement(
    lm, codec: str, prompts: list[list[int]], refs: list, gaps: list, max_tokens: int
) -> dict:
    """Greedy continuations with each prompt's prefix read from the tier through `codec`;
    `gaps`: each one's `continuation_gaps`, which say how near a tie a changed token was."""
    from engine.contract import FP32_TOL, count_meeting_contract
    from engine.loop.engine import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=max_tokens)
    tol = max(FP32_TOL, CODEC_TOLERANCE[codec])
    same, outputs, tier_tokens, divergences = 0, [], 0, []
    with tempfile.TemporaryDirectory() as tmp:
        with Engine(lm, tier_config(codec, tmp)) as writer:
            for prompt in prompts:
                writer.prefill_logits(prompt)  # stores its blocks, written through
        with Engine(lm, tier_config(codec, tmp)) as reader:
            for i, (prompt, ref) in enumerate(zip(prompts, refs, strict=True)):
                reader.on_loop(reader.cache.evict_device)
                result = reader.generate([prompt], params)[0]
                out = result.output_token_ids
                same += out == ref
                outputs.append(out)
                tier_tokens += result.cached_by_tier.get("lmdb", 0)
                if result.output_token_ids != ref:
                    at = first_difference(result.output_token_ids, ref)
                    divergences.append({"prompt": i, "token": at, "top2_gap": gaps[i][at]})
            meets = reader.on_loop(lambda: count_meeting_contract(lm, prompts, outputs, tol=tol))
    return {"identical": same, "prompts": len(prompts), "identical_share": same / len(prompts),
            "meet_contract": meets, "tier_cached_tokens": tier_tokens,
            "divergences": divergences}  # fmt: skip


def first_difference(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def top2_gaps(lm, ids: list[int], first: int) -> list[float]:
    """The no-cache logit gap between the two likeliest next tokens after each of ids[:first
    + 1], ids[:first + 2], ... ids: how close to a tie each greedy token was."""
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([ids])).logits[0, first:].float()
    top = torch.topk(logits, 2, dim=-1).values  # [positions, 2]
    return (top[:, 0] - top[:, 1]).tolist()


# --- the run ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    from engine.model.loading import load_model

    lm = load_model(args.model)
    ids = lm.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    reference, kv = text_kv(lm, ids)
    prompts, refs, gaps = demo_prompts(lm, args.max_tokens, args.prompts)
    rows = []
    for codec in tqdm(args.codecs, desc="codecs"):
        row = {"codec": codec} | perplexity(lm, ids, codec, args.chunk, reference, kv)
        rows.append(row | agreement(lm, codec, prompts, refs, gaps, args.max_tokens))
    pools = pool_rows(lm, args.kv_cache_dtypes, ids, prompts, args.max_tokens) if (
        args.kv_cache_dtypes) else []  # fmt: skip
    return {"model": args.model, "text_tokens": len(ids), "max_tokens": args.max_tokens,
            "prompt_tokens": [len(p) for p in prompts],
            "reference_ties": [closest_tie(g[:-1]) for g in gaps],
            "results": rows, "pools": pools}  # fmt: skip


def print_table(report: dict) -> None:
    if not report["results"]:
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"quantized tier codecs on {report['model']}: perplexity of a "
                  f"{report['text_tokens']}-token text, {report['max_tokens']}-token greedy "
                  "continuations, each against no cache")  # fmt: skip
    for col in ("codec", "ppl", "ppl no cache", "change", "max |Δlogit|", "identical",
                "meet contract"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in report["results"]:
        table.add_row(
            r["codec"],
            f"{r['ppl']:.4f}",
            f"{r['ppl_nocache']:.4f}",
            f"{r['ppl_change']:+.2%}",
            f"{r['max_logit_change']:.3g}",
            f"{r['identical']}/{r['prompts']} ({r['identical_share']:.0%})",
            f"{r['meet_contract']}/{r['prompts']}",
        )
    Console().print(table)
    for r in report["results"]:
        for d in r["divergences"]:
            print(f"{r['codec']}: prompt {d['prompt'] + 1} differs from token {d['token'] + 1}, "
                  f"where no cache's top two logits are {d['top2_gap']:.3f} apart")  # fmt: skip
    ties = ", ".join(f"{i + 1}: {t['top2_gap']:.3f} (token {t['token'] + 1})"
                     for i, t in enumerate(report["reference_ties"]))  # fmt: skip
    print(f"no cache's closest top-two gap in each prompt's continuation: {ties}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv or [])
    torch.set_num_threads(args.threads)
    report = run(args)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
        print_pool_table(report)
    control = [r for r in report["results"] if r["codec"] == "none"]
    exact = all(r["identical"] == r["prompts"] for r in control)
    # within a pool's dtype, a hit reads what its miss read: the same tokens
    return 0 if exact and all(r["hit_equals_miss"] == r["prompts"] for r in report["pools"]) else 1
