"""`kvstore demo`: a 4-turn chat and 4 questions sharing a system prompt, on SmolLM2-135M-Instruct
by default (`--model tiny` for the random-weight test model).

The chat goes through the model's own chat template: each turn renders the whole history,
the earlier answers included, so a turn hits the cache for the previous turn's prompt and
answer. Every request is compared with a no-cache greedy run of the same model (a plain
forward loop without kvstore, on the engine's thread and linear kernels). With a
shared tier configured (`--lmdb-dir`, `--redis-url`), a second pass replays the questions on
a fresh engine whose device pool is empty, so its cached tokens come from that tier.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore.config import CacheConfig

if TYPE_CHECKING:
    import torch

    from engine.loop.engine import Engine, GenerateResult
    from engine.loop.threads import ThreadConfig
    from engine.model.loading import LoadedModel

DEFAULT_MODEL = "smollm2"
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
SYSTEM_PROMPT = "You are a careful and friendly assistant. " + " ".join(
    f"Rule {i + 1}: {rule}, and remember rule {i + 1} in every turn of the conversation."
    for i, rule in enumerate(_SYSTEM_RULES)
)
CHAT_TURNS = (
    "What is the capital of France?",
    "What is the capital of Italy?",
    "Which of those two cities has more inhabitants?",
    "Thanks. Summarize our conversation in one sentence.",
)
BATCH_QUESTIONS = (
    "What is the capital of Spain?",
    "What is the largest planet of the solar system?",
    "Who wrote Romeo and Juliet?",
    "What do bees make?",
)
Row = dict[str, Any]


def num_requests(config: CacheConfig) -> int:
    """8, and 4 more (a second pass) with a shared tier."""
    passes = 2 if config.lmdb_dir or config.redis_url else 1
    return len(CHAT_TURNS) + passes * len(BATCH_QUESTIONS)


def device_name(device: torch.device) -> str:
    """`CPU`, or `GPU (cuda:0, <its name>)`."""
    import torch

    if device.type != "cuda":
        return device.type.upper()
    return f"GPU ({device}, {torch.cuda.get_device_name(device)})"


def model_label(model_name: str) -> str:
    from engine.model.gguf import BUILTINS

    if model_name in BUILTINS:
        return BUILTINS[model_name].description.split(" (")[0]
    return f"{model_name} model ({TINY_NOTE})" if model_name == "tiny" else model_name


class _Demo:
    """One model's demo requests, each compared with a no-cache run as it finishes."""

    def __init__(self, model: LoadedModel, max_tokens: int, on_row: Callable[[Row], None] | None):
        from engine.loop.engine import SamplingParams

        self.model, self.tok, self.on_row = model, model.tokenizer, on_row
        self.params = SamplingParams(max_new_tokens=max_tokens)
        self.system = {"role": "system", "content": SYSTEM_PROMPT}

    def ids(self, messages: list[dict]) -> list[int]:
        """The history through the model's chat template, ready for the answer."""
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def chat(self, engine: Engine) -> list[Row]:
        messages, rows = [self.system], []
        for turn, question in enumerate(CHAT_TURNS):
            messages.append({"role": "user", "content": question})
            ids = self.ids(messages)
            result = engine.generate([ids], self.params)[0]
            messages.append({"role": "assistant", "content": result.text})
            rows.append(self.compare(engine, f"chat turn {turn + 1}", question, ids, result))
        return rows

    def batch(self, engine: Engine, prefix: str = "") -> list[Row]:
        questions = BATCH_QUESTIONS
        prompts = [self.ids([self.system, {"role": "user", "content": q}]) for q in questions]
        results = engine.generate(prompts, self.params)
        return [
            self.compare(engine, f"{prefix}question {i + 1}", q, ids, result)
            for i, (q, ids, result) in enumerate(zip(questions, prompts, results, strict=True))
        ]

    def compare(
        self, engine: Engine, name: str, question: str, ids: list[int], result: GenerateResult
    ) -> Row:
        """The request against a no-cache greedy run, run as the engine runs the model (its
        thread and linear kernels: the speed-up is the cache's alone)."""
        from engine.loop.sequential import reference_generate

        n, stops = len(result.output_token_ids), self.model.eos_token_ids
        ref, ttft_nocache = engine.on_loop(lambda: reference_generate(self.model, ids, n, stops))
        row = {
            "name": name, "question": question, "answer": result.text,
            "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
            "completion_tokens": n, "cached_by_tier": result.cached_by_tier,
            "ttft_s": result.ttft_s, "ttft_nocache_s": ttft_nocache,
            "identical": ref == result.output_token_ids,
        }  # fmt: skip
        if self.on_row is not None:
            self.on_row(row)
        return row


def run_demo_requests(
    model: LoadedModel,
    max_tokens: int,
    config: CacheConfig,
    on_row: Callable[[Row], None] | None = None,
    threads: ThreadConfig | None = None,
) -> list[Row]:
    """Run the demo's requests through the engine and compare each with a no-cache run;
    `on_row(row)` is called as each comparison is done (progress)."""
    from engine.loop.engine import Engine
    from engine.loop.sequential import reference_generate

    demo = _Demo(model, max_tokens, on_row)
    with Engine(model, config, thread_config=threads) as engine:
        engine.on_loop(lambda: reference_generate(model, list(range(64)), 2))  # warm-up
        rows = demo.chat(engine) + demo.batch(engine)
    if config.lmdb_dir or config.redis_url:  # closing flushed the writes: a fresh device pool
        with Engine(model, config, thread_config=threads) as engine:
            rows += demo.batch(engine, "pass 2, ")
    return rows


def _tiers(config: CacheConfig) -> str:
    names = ["device"]
    names += ["memory"] if config.memory_cache_gb > 0 else []
    names += ["lmdb"] if config.lmdb_dir else []
    names += ["redis"] if config.redis_url else []
    return " + ".join(names)


def demo_header(model_name: str, config: CacheConfig, device: torch.device) -> str:
    """What the demo runs, on what: said before it starts."""
    return (
        f"{model_label(model_name)} on {device_name(device)}, tiers {_tiers(config)}: "
        f"{num_requests(config)} requests, each checked against a no-cache run"
    )


NOTES = (
    "speed-up = no-cache TTFT / TTFT. A first turn has nothing cached: its ratio is noise "
    "around 1x. The questions arrive together and are prefilled in the same engine steps, "
    "so several share one TTFT. Cached tokens are whole blocks (--block-size), and in a "
    "chat's next turn also the previous turn's partly filled last block; the last prompt "
    "token is always computed."
)


def _speedup(row: Row) -> str:
    return f"{row['ttft_nocache_s'] / row['ttft_s']:.1f}x" if row["cached_tokens"] else "-"


def print_demo_table(report: dict, model_name: str, config: CacheConfig, device: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    title = f"kvstore demo: {model_label(model_name)}, {device_name(device)}, {_tiers(config)}"
    table = Table(title=title)
    cols = ("request", "prompt", "cached", "from", "TTFT ms", "no-cache ms", "speed-up", "same")
    for col in cols:
        table.add_column(col, justify="right")
    for row in report["requests"]:
        table.add_row(
            row["name"], str(row["prompt_tokens"]), str(row["cached_tokens"]),
            " + ".join(f"{n} {tier}" for tier, n in row["cached_by_tier"].items()) or "-",
            f"{row['ttft_s'] * 1e3:.1f}", f"{row['ttft_nocache_s'] * 1e3:.1f}", _speedup(row),
            "yes" if row["identical"] else "NO",
        )  # fmt: skip
    console = Console(width=max(Console().width, 110))
    _print_chat(console, report["requests"])
    console.print(table)
    console.print(NOTES, style="dim")
    console.print(f"all identical: {report['all_identical']}  runtime {report['runtime_s']:.1f} s")


def _print_chat(console: Any, rows: list[Row]) -> None:
    for row in rows:
        if row["name"].startswith("chat"):
            console.print(f"[bold]user:[/bold] {row['question']}")
            console.print(f"[bold]assistant:[/bold] {row['answer'].strip()}", highlight=False)
    console.print()
