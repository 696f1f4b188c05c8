"""`python -m bench codecs`: what each tier payload codec costs and what it changes.

For each codec (none, fp16, bf16, lz4, zstd), on the real KV the pinned `tiny` model writes
for a prompt: stored bytes as a fraction of the raw KV, encode and verified-decode speed as a
ratio to a plain copy of the same bytes (measured in the same run, interleaved, medians), and
the largest change of the next-token logits when the cached prefix comes back through the
codec (0 for the lossless ones; the lossy codecs are held to their own tolerance).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np
import torch
from tqdm import tqdm

from hashing import BlockHasher
from kvstore.config import CODEC_NAMES, CODEC_TOLERANCE
from kvstore.entry import BlockEntry, decode_entry, encode_entry


def _median_s(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def real_kv(num_tokens: int, block_size: int):
    """The tiny model, a prompt, its prefill KV as blocks [n, layers, 2, heads, bs, dim]."""
    from transformers import DynamicCache

    from engine.model.loading import load_model, with_cache

    model = load_model("tiny")
    ids = torch.tensor([list(range(num_tokens))]) % model.vocab_size
    past = DynamicCache(config=model.model.config)
    with torch.inference_mode():
        model.model(input_ids=ids, use_cache=True, **with_cache(model.model, past))
    layers = [(layer.keys[0], layer.values[0]) for layer in past.layers]
    kv = torch.stack([torch.stack(pair) for pair in layers])  # [layers, 2, heads, T, dim]
    n = num_tokens // block_size
    kv = kv[:, :, :, : n * block_size].unflatten(3, (n, block_size)).permute(3, 0, 1, 2, 4, 5)
    return model, ids[0, : n * block_size].numpy().astype(np.uint32), kv.contiguous()


def _next_logits(model, token_ids: np.ndarray, blocks: torch.Tensor, probe: int) -> torch.Tensor:
    """Logits after `probe` on top of the prefix KV held in `blocks` (a DynamicCache)."""
    from transformers import DynamicCache

    from engine.model.loading import with_cache

    past = DynamicCache(config=model.model.config)
    seq = blocks.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)  # [layers, 2, heads, T, dim]
    for i, layer in enumerate(past.layers):
        k, v = seq[i, 0].unsqueeze(0).contiguous(), seq[i, 1].unsqueeze(0).contiguous()
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    n = len(token_ids)
    with torch.inference_mode():
        out = model.model(
            input_ids=torch.tensor([[probe]]),
            position_ids=torch.tensor([[n]]),
            use_cache=True,
            **with_cache(model.model, past),
        )
    return out.logits[0, -1].float()


def run(num_tokens: int, rounds: int, block_size: int = 16) -> dict:
    model, tokens, kv = real_kv(num_tokens, block_size)
    ns = model.namespace(block_size)
    hasher = BlockHasher(ns)
    keys, digests = hasher.hash_blocks(tokens), hasher.digest_blocks(tokens)
    parents = [hasher.root, *keys[:-1]]
    raw_bytes = kv.numel() * kv.element_size()
    reference = _next_logits(model, tokens, kv, probe=7)
    results = []
    for codec in tqdm(CODEC_NAMES, desc="codecs"):
        root = dataclasses.replace(ns, codec=codec).root()  # the codec is part of the namespace

        def entries(c: str = codec, r: bytes = root) -> list[bytes]:
            return [
                encode_entry(
                    BlockEntry(
                        r,
                        keys[i],
                        digests[i],
                        parents[i],
                        tokens[i * block_size : (i + 1) * block_size],
                        kv[i],
                    ),
                    c,
                )
                for i in range(len(keys))
            ]

        stored = entries()

        def decode(s: list[bytes] = stored, r: bytes = root) -> torch.Tensor:
            return torch.stack(
                [
                    decode_entry(v, namespace=r, key=keys[i], digest=digests[i], dtype=kv.dtype).kv
                    for i, v in enumerate(s)
                ]
            )

        copy = kv.clone()
        times = {"encode": [], "decode": [], "copy": []}
        for _ in range(rounds):  # interleaved
            times["copy"].append(_median_s(lambda d=copy: d.copy_(kv), 1))
            times["encode"].append(_median_s(entries, 1))
            times["decode"].append(_median_s(decode, 1))
        med = {k: statistics.median(v) for k, v in times.items()}
        error = float((_next_logits(model, tokens, decode(), probe=7) - reference).abs().max())
        results.append(
            {
                "codec": codec,
                "stored_fraction": sum(map(len, stored)) / raw_bytes,
                "encode_gbps": raw_bytes / med["encode"] / 1e9,
                "decode_gbps": raw_bytes / med["decode"] / 1e9,
                "copy_gbps": raw_bytes / med["copy"] / 1e9,
                "max_logit_error": error,
                "tolerance": CODEC_TOLERANCE[codec],
                "within_tolerance": error <= CODEC_TOLERANCE[codec],
            }
        )
    return {"prompt_tokens": len(tokens), "raw_bytes": raw_bytes, "results": results}


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"tier codecs: tiny model KV of {report['prompt_tokens']} tokens "
        f"({report['raw_bytes'] / 2**20:.1f} MiB)"
    )
    for col in ("codec", "stored", "encode GB/s", "decode GB/s", "copy GB/s", "max |Δlogit|", "ok"):
        table.add_column(col, justify="right")
    for r in report["results"]:
        table.add_row(
            r["codec"],
            f"{r['stored_fraction']:.2f}",
            f"{r['encode_gbps']:.2f}",
            f"{r['decode_gbps']:.2f}",
            f"{r['copy_gbps']:.2f}",
            f"{r['max_logit_error']:.2e}",
            "yes" if r["within_tolerance"] else "NO",
        )
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench codecs", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    report = run(args.prompt_tokens, args.rounds)
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
    return 0
