"""The servers `bench load` compares, on one saved model directory: `kvstore serve` and
`transformers serve --continuous-batching` (the peer), each a `bench.launch.ServerProcess`,
or a kvstore server already running at `--url`."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.launch import ServerProcess, free_port
from bench.load.workload import session_tokens_bound
from bench.serve import served_model, wait_ready
from kvstore.units import cdiv

BLOCK_TOKENS = 16  # kvstore's block and CB's page, both servers
READY_TIMEOUT_S = 180.0  # model load on a busy 2-core machine
KVSTORE, PEER = "kvstore", "peer"
PEER_LABEL = "transformers serve --continuous-batching"


def served_dtype(name: str, device: str) -> str:
    """Both servers' dtype: a dummy:NAME shape's on a GPU is bfloat16 (as it is served),
    every other model's float32."""
    return "bfloat16" if name.startswith("dummy:") and device != "cpu" else "float32"


def prepare_model(name: str, workdir: Path, device: str = "cpu") -> Path:
    """A local model directory as is; `tiny` (or another built-in name, or a dummy:NAME
    shape, built on `device`) saved, model and tokenizer, under `workdir`, so both servers
    load the same weights."""
    path = Path(name)
    if path.is_dir():
        return path.resolve()
    from transformers.utils import logging as hf_logging

    from engine.model.gguf import gguf_model_dir
    from engine.model.loading import load_model

    converted = gguf_model_dir(name)
    if converted is not None:  # smollm2 or a .gguf file: the converted directory, as it is
        return converted[0]

    hf_logging.disable_progress_bar()  # "Writing model shards" on stderr
    loaded = load_model(name, served_dtype(name, device), device)
    out = workdir / name.replace(":", "-")
    loaded.model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    del loaded  # (a GPU's memory back before the servers start)
    return out


def pool_blocks(sessions: int, turns: int, max_tokens: int, system_bytes: int) -> int:
    """A KV pool (blocks) holding `sessions` whole sessions and the warm-up one: nothing is
    evicted in a level. Both servers get this many. (CB plans attention masks of
    max_batch_tokens x its pool's tokens: with a 1 GiB pool of the tiny model's blocks,
    8192, it refuses every request, "Memory footprint ... is more than available memory".)"""
    per_session = session_tokens_bound(turns, max_tokens, system_bytes)
    return (sessions + 1) * cdiv(per_session, BLOCK_TOKENS)


def kvstore_command(
    model_dir: Path, port: int, blocks: int, device: str = "cpu", dtype: str = "float32"
) -> list[str]:
    return [sys.executable, "-m", "engine.cli", "serve", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--device", device, "--dtype", dtype,
            "--block-size", str(BLOCK_TOKENS), "--device-blocks", str(blocks),
            "--log-level", "warning"]  # fmt: skip


def peer_command(
    model_dir: Path, port: int, blocks: int, device: str = "cpu", dtype: str = "float32"
) -> list[str]:
    return [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir),
            "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
            "--device", device, "--dtype", dtype, "--cb-block-size", str(BLOCK_TOKENS),
            "--cb-num-blocks", str(blocks), "--log-level", "warning"]  # fmt: skip


def peer_env() -> dict[str, str]:
    """No network: the model is a local directory."""
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return {**os.environ, **offline}


def kvstore_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}


LAUNCHERS = {
    KVSTORE: (kvstore_command, kvstore_env, "kvstore serve"),
    PEER: (peer_command, peer_env, PEER_LABEL),
}


@dataclass
class Running:
    """A server ready for requests: its URL, the body fields it needs, how to stop it."""

    url: str
    extra: dict
    process: ServerProcess | None = None  # None: not ours (--url), never stopped

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@dataclass
class Target:
    """One server under test and how to bring it up; `command` is the last one started."""

    name: str
    model_dir: Path
    log_dir: Path
    blocks: int  # KV pool, in blocks of BLOCK_TOKENS
    url: str | None = None  # an existing kvstore server
    api_key: str | None = None
    device: str = "cpu"  # both servers' model and KV pool
    dtype: str = "float32"  # both servers' (`served_dtype`)
    extra_args: list[str] = field(default_factory=list)  # appended to the server's command
    command: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return LAUNCHERS[self.name][2]

    @property
    def restartable(self) -> bool:
        return self.url is None

    def start(self) -> Running:
        """Start the server (or reach the one at `url`); RuntimeError naming why not."""
        if self.url is not None:
            return self._external()
        make_command, make_env, label = LAUNCHERS[self.name]
        port = free_port()
        self.command = [
            *make_command(self.model_dir, port, self.blocks, self.device, self.dtype),
            *self.extra_args,
        ]
        log = self.log_dir / f"{self.name}.log"
        process = ServerProcess(self.command, port, log, make_env(), label, READY_TIMEOUT_S)
        try:  # BaseException too: a SIGTERM (SystemExit) while waiting must not orphan it
            process.start().wait_ready()
            return Running(process.url, self.body_fields(process.url), process)
        except BaseException:
            process.stop()
            raise

    def _external(self) -> Running:
        with httpx.Client() as client:
            wait_ready(client, [self.url], 30.0)
        return Running(self.url, self.body_fields(self.url))

    def body_fields(self, url: str) -> dict:
        """kvstore: its served name, ignore_eos, usage in the stream. The peer takes no
        unknown field (422): the model is its preloaded path; a generation_config with no EOS
        (-1) makes it generate max_tokens tokens too; it always sends usage, and ignores (with
        a warning) stream_options."""
        if self.name == KVSTORE:
            with httpx.Client() as client:
                model = served_model(client, url, self.api_key)
            return {"model": model, "ignore_eos": True, "stream_options": {"include_usage": True}}
        config = {"do_sample": False, "eos_token_id": -1}
        return {"model": str(self.model_dir), "generation_config": json.dumps(config)}
