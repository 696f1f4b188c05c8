"""TTFT with a cached prefix per tier, as a ratio to the ideal suffix-only prefill.

For each point (prompt of N tokens, P of them cached) three variants run interleaved:
- nocache: full prefill of the N tokens + first token;
- ideal: prefill of the N - P suffix on top of an in-memory DynamicCache of the prefix
  (cloned outside the timed region, since a forward mutates it) + first token;
- kvstore: the engine's path (lookup, load into a DynamicCache, suffix prefill) + first
  token, through a PrefixCache holding exactly that prefix in the given tier.
Times are medians over `--runs` rounds after one warm-up round; ratio_to_ideal is the median
of the per-round kvstore/ideal ratios (the two run back to back, so load from other
processes on the machine cancels). The pinned `tiny` model in fp32 by default (the yardstick
of docs/BENCHMARKS.md: nobody shrinks KV to pass), `--model smollm2` for the real one.

`--sweep` measures a grid of prompt lengths x cached fractions, with HF `generate` and
transformers continuous batching as peers, and plots it: see `bench.ttft.sweep`.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import torch

from bench.throttle import ThrottledProxy
from bench.ttft.point import (
    TIERS,
    device_cell,
    device_ms_cell,
    full_kv,
    measure_point,
    print_table,
    tier_label,
)
from engine.extras import require
from engine.loop.threads import on_own_thread
from hashing import KV_CACHE_DTYPES
from kvstore.config import CODEC_NAMES, CODEC_TOLERANCE, ConfigError
from kvstore.device.pool import resolve_device


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench ttft", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (the pinned yardstick), smollm2, "
                   "dummy:NAME, a .gguf file or a model directory")  # fmt: skip
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="the model's and the KV pool's device")  # fmt: skip
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16; auto: "
                   "float32, and a dummy:NAME model's bfloat16 on a GPU")  # fmt: skip
    p.add_argument("--tier", default=None, help="comma-separated: device,memory,lmdb,redis; "
                   "a spill tier as memory:layers loads layer by layer during the forward, "
                   "memory:whole reads whole entries before it (layer_loads on, off; "
                   "plain: the default, off)")  # fmt: skip
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--cached", default="1792,2032", help="comma-separated cached-token points")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--runs", type=int, default=None, help="timed rounds per point (9; sweep 3)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--redis-url", default=None)
    p.add_argument("--throttle-mbps", type=float, default=None, help="put a loopback proxy "
                   "pacing each direction to this many MB/s in front of --redis-url (a slow "
                   "tier on any machine)")  # fmt: skip
    p.add_argument("--read-gate", choices=("on", "off"), default="on", help="read a tier only "
                   "when fetching beats recomputing (tier_read_gate)")  # fmt: skip
    p.add_argument("--codec", default="none", help="comma-separated tier codecs (none, fp16, "
                   "bf16, lz4, zstd, int8, fp8): each spill tier runs under each")  # fmt: skip
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the pool's storage (a quantized pool's tier entries are its blocks: "
                   "--codec none)")  # fmt: skip
    p.add_argument("--lmdb-dir", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--sweep", action="store_true", help="prompt lengths x cached fractions")
    p.add_argument("--lengths", default="512,1024,2048", help="sweep prompt lengths")
    p.add_argument("--fractions", default="0.25,0.5,0.75,0.9", help="sweep cached fractions")
    p.add_argument("--out", default=None, help="sweep: directory for ttft_sweep.png")
    args = p.parse_args(argv)
    try:  # the pool's own check: a GPU this machine has
        resolve_device(args.device)
    except ConfigError as e:
        p.error(f"--{e}")
    if args.sweep:
        from bench.ttft.sweep import sweep_args

        return sweep_args(p, args)
    args.runs = 9 if args.runs is None else args.runs
    if args.throttle_mbps is not None and (args.throttle_mbps <= 0 or not args.redis_url):
        p.error("--throttle-mbps: give a positive rate, and --redis-url for it to slow down")
    args.tiers = [t.strip() for t in (args.tier or "device").split(",") if t.strip()]
    args.codecs = [c.strip() for c in args.codec.split(",") if c.strip()] or ["none"]
    for codec in args.codecs:
        if codec not in CODEC_NAMES:
            p.error(f"--codec: unknown codec {codec!r}; choose from {','.join(CODEC_NAMES)}")
    if any(t.endswith(":layers") for t in args.tiers) and args.codecs != ["none"]:
        p.error("--codec: layer-by-layer loads read codec none only (docs/FORMAT.md)")
    if args.kv_cache_dtype != "auto" and (
        args.codecs != ["none"] or any(":" in t for t in args.tiers)
    ):
        p.error(
            "--kv-cache-dtype: its tiers hold its blocks as they are (--codec none, whole reads)"
        )
    args.points = [int(c) for c in args.cached.split(",") if c.strip()]
    for tier in args.tiers:
        name, _, how = tier.partition(":")
        if name not in TIERS or how not in ("", "layers", "whole") or (how and name == "device"):
            choices = ",".join(TIERS)
            p.error(f"--tier: unknown tier {tier!r}; choose from {choices}; a spill tier may "
                    "end in ':layers' or ':whole' (layer_loads on or off)")  # fmt: skip
    for cached in args.points:
        if cached % args.block_size or not 0 < cached < args.prompt_tokens:
            p.error(f"--cached {cached}: must be a multiple of --block-size below --prompt-tokens")
    return args


def main(argv: list[str], model=None) -> int:
    """`model` (a LoadedModel) replaces the pinned tiny model, for tests."""
    from transformers.utils import logging as hf_logging

    from engine.model.loading import load_model

    args = parse_args(argv)
    if args.out:  # before any work: no partial --out
        require("matplotlib", needed_by="--out")
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    lm = model or load_model(args.model, args.dtype, args.device)
    if args.sweep:
        from bench.ttft.sweep import run_sweep

        return run_sweep(lm, args)
    rng = random.Random(0)
    ids = [rng.randrange(256) for _ in range(args.prompt_tokens)]
    kv = on_own_thread(full_kv, lm.model, ids)  # no OpenMP team left here (engine/loop/threads.py)
    gc.collect()
    gc.freeze()  # long-lived objects out of the collector, so timed() collects cheaply
    with throttled(args):
        points = [
            measure_point(lm, ids, kv, tier, cached, args, codec)
            for tier in args.tiers
            for codec in (["none"] if tier == "device" else args.codecs)
            for cached in args.points
        ]
    if args.json:
        print(json.dumps({"points": points}))
    else:
        print_table(points, args, EXTRA_COLUMNS)
        print_gate(points)
    # a lossy codec or pool may move the first token (its contract: docs/FORMAT.md)
    lossless = args.kv_cache_dtype == "auto"
    exact = [
        p for p in points if lossless and CODEC_TOLERANCE[p["codec"]] <= CODEC_TOLERANCE["none"]
    ]
    return 0 if all(p["same_first_token"] for p in exact) else 1


EXTRA_COLUMNS = [
    ("device ms", device_ms_cell),
    ("÷ device", device_cell),
    ("÷ no cache", lambda p: f"{p['ratio_to_nocache']:.3f}"),
    ("gate skips", lambda p: str(p["read_skipped"])),
]


@contextmanager
def throttled(args: argparse.Namespace) -> Iterator[None]:
    """With --throttle-mbps: --redis-url replaced, while the block runs, by a throttled
    proxy's in front of it."""
    if args.throttle_mbps is None:
        yield
        return
    url = urlsplit(args.redis_url)
    target = (url.hostname or "127.0.0.1", url.port or 6379)
    with ThrottledProxy(*target, args.throttle_mbps * 1e6) as proxy:
        original, args.redis_url = args.redis_url, proxy.url(url.scheme, url.path or "/0")
        try:
            yield
        finally:
            args.redis_url = original


def print_gate(points: list[dict]) -> None:
    """What the read gate measured by the end of each spill tier's last point."""
    last = {tier_label(p): p["read_gate"] for p in points if p["read_gate"] is not None}
    for tier, gate in last.items():
        rates = ", ".join(
            f"{name} {bw / 1e6:.1f} MB/s"
            for name, bw in gate["bandwidth_bytes_per_s"].items()
            if bw
        )
        tokens = gate["prefill_tokens_per_s"]
        prefill = "not measured" if tokens is None else f"{tokens:.0f} tokens/s"
        print(f"read gate after {tier}: prefill {prefill}; reads {rates or 'not measured'}")
