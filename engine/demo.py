"""`kvstore demo`: a 4-turn chat and 8 prompts sharing a system prompt on the tiny model.

Every request is compared with a no-cache greedy run. With a shared tier configured
(`--lmdb-dir`, `--redis-url`), a second pass replays the batch on a fresh engine whose device
pool is empty, so its cached tokens come from that tier.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.config import CacheConfig

if TYPE_CHECKING:
    import torch

TINY_NOTE = "random weights: its text is noise; what counts is cached output = uncached output"

_SYSTEM_RULES = (
    "answer in plain words and keep every reply short",
    "when a question is ambiguous, ask one clarifying question first",
    "never invent facts; say that you do not know instead",
    "prefer concrete examples over abstract explanations",
    "quote numbers with their units and their source",
    "use lists only when the order of the steps matters",
    "summarize long documents before answering questions about them",
    "keep code samples small, complete and runnable",
)
SYSTEM_PROMPT = "You are the kvstore demo assistant, a careful and friendly helper. " + " ".join(
    f"Rule {i + 1}: {rule}, and remember rule {i + 1} in every turn of the conversation."
    for i, rule in enumerate(_SYSTEM_RULES)
)
CHAT_TURNS = (
    "Hello! What does a prefix cache store, in one sentence?",
    "And why does the last prompt token always have to be computed?",
    "How would you size the device pool for a chat service?",
    "Thanks. Summarize our conversation in one line.",
)
BATCH_QUESTIONS = tuple(
    f"Question {i + 1}: explain topic number {i + 1} of the course, {topic}, to a beginner."
    for i, topic in enumerate(
        (
            "hash chains",
            "radix trees",
            "paged memory",
            "eviction",
            "spill tiers",
            "checksums",
            "circuit breakers",
            "time to first token",
        )
    )
)


def num_requests(config: CacheConfig) -> int:
    """12, and 8 more (a second pass) with a shared tier."""
    passes = 2 if config.lmdb_dir or config.redis_url else 1
    return len(CHAT_TURNS) + passes * len(BATCH_QUESTIONS)


def device_name(device: torch.device) -> str:
    """`CPU`, or `GPU (cuda:0, <its name>)`."""
    import torch

    if device.type != "cuda":
        return device.type.upper()
    return f"GPU ({device}, {torch.cuda.get_device_name(device)})"


def run_demo_requests(
    max_tokens: int,
    config: CacheConfig,
    device: torch.device | str = "cpu",
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Run the demo's requests through the engine and compare each with a no-cache run;
    `on_row(row)` is called as each comparison is done (progress)."""
    from engine.engine import Engine, SamplingParams
    from engine.model import END_OF_TURN, load_model
    from engine.sequential import reference_generate

    model = load_model("tiny", device=device)
    tok = model.tokenizer
    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    reference_generate(model, list(range(64)), 2)  # warm-up, not reported
    system = {"role": "system", "content": SYSTEM_PROMPT}

    def chat_ids(question: str) -> list[int]:
        messages = [system, {"role": "user", "content": question}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    def compare(name: str, ids: list[int], result) -> dict:
        ref, ttft_nocache = reference_generate(model, ids, len(result.output_token_ids))
        row = {
            "name": name,
            "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens,
            "cached_by_tier": result.cached_by_tier,
            "ttft_s": result.ttft_s,
            "ttft_nocache_s": ttft_nocache,
            "identical": ref == result.output_token_ids,
        }
        if on_row is not None:
            on_row(row)
        return row

    rows = []
    with Engine(model, config) as engine:
        ids, output = chat_ids(CHAT_TURNS[0]), []
        for turn, question in enumerate(CHAT_TURNS):
            if turn:  # the history is tokens, so turn k+1 can hit turn k's generated tokens
                follow = f"{END_OF_TURN}\nuser: {question}{END_OF_TURN}\nassistant: "
                ids = ids + output + tok(follow, add_special_tokens=False)["input_ids"]
            result = engine.generate([ids], params)[0]
            output = result.output_token_ids
            rows.append(compare(f"chat turn {turn + 1}", ids, result))
        batch = [chat_ids(q) for q in BATCH_QUESTIONS]
        for i, (ids, result) in enumerate(zip(batch, engine.generate(batch, params), strict=True)):
            rows.append(compare(f"batch {i + 1}", ids, result))
    if config.lmdb_dir or config.redis_url:  # closing flushed the writes: a fresh device pool
        with Engine(model, config) as engine:
            results = engine.generate(batch, params)
        for i, (ids, result) in enumerate(zip(batch, results, strict=True)):
            rows.append(compare(f"pass 2, batch {i + 1}", ids, result))
    return rows


def _tiers(config: CacheConfig) -> str:
    names = ["device"]
    names += ["memory"] if config.memory_cache_gb > 0 else []
    names += ["lmdb"] if config.lmdb_dir else []
    names += ["redis"] if config.redis_url else []
    return " + ".join(names)


def demo_header(config: CacheConfig, device: torch.device) -> str:
    """What the demo runs, on what: said before it starts."""
    return (
        f"tiny model ({TINY_NOTE}) on {device_name(device)}, tiers {_tiers(config)}: "
        f"{num_requests(config)} requests, each checked against a no-cache run"
    )


def print_demo_table(report: dict, config: CacheConfig, device: torch.device) -> None:
    from rich.console import Console
    from rich.table import Table

    title = f"kvstore demo: tiny model (random weights), {device_name(device)}, {_tiers(config)}"
    table = Table(title=title)
    cols = ("request", "prompt", "cached", "from", "TTFT ms", "no-cache ms", "speedup", "same")
    for col in cols:
        table.add_column(col, justify="right")
    for row in report["requests"]:
        table.add_row(
            row["name"],
            str(row["prompt_tokens"]),
            str(row["cached_tokens"]),
            " + ".join(f"{n} {tier}" for tier, n in row["cached_by_tier"].items()) or "-",
            f"{row['ttft_s'] * 1e3:.1f}",
            f"{row['ttft_nocache_s'] * 1e3:.1f}",
            f"{row['ttft_nocache_s'] / row['ttft_s']:.1f}x",
            "yes" if row["identical"] else "NO",
        )
    console = Console(width=max(Console().width, 110))
    console.print(table)
    console.print(f"all identical: {report['all_identical']}  runtime {report['runtime_s']:.1f} s")
