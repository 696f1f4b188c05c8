"""`kvstore serve` on the micro model in its own process, for the HTTP fault: sends a case
and reads the index's /metrics series."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx

from bench.faults.common import Context, wait_for
from bench.faults.http.cases import (
    AUTH,
    COMPLETIONS,
    KEYS,
    MAX_BODY,
    MAX_PROMPT,
    MAX_TOKENS,
    MODEL,
    WARM,
    Case,
    base,
)
from bench.launch import free_port

INDEX = {  # name -> the /metrics series an admitted request moves
    "device_cached": 'kvstore_device_blocks{state="cached"}',
    "device_free": 'kvstore_device_blocks{state="free"}',
    "device_evictable": 'kvstore_device_blocks{state="evictable"}',
    "stored_blocks": "kvstore_stored_blocks_total",
    "lookups": "kvstore_lookups_total",
    "requests_run": 'kvstore_requests_total{outcome="ok"}',
}


class Server:
    """`kvstore serve` on the micro model in its own process (no KVSTORE_* settings from the
    environment): tenants a and b, small body, prompt and max_tokens limits, keyed /metrics."""

    def __init__(self, ctx: Context):
        model_dir, keys_file = ctx.workdir / "http-model", ctx.workdir / "http-keys.json"
        ctx.model.model.save_pretrained(model_dir)
        ctx.model.tokenizer.save_pretrained(model_dir)
        keys_file.write_text(json.dumps(KEYS))
        port, self.log = free_port(), ctx.workdir / "http-server.log"
        self.args = [
            sys.executable,
            "-m",
            "engine.cli",
            "serve",
            "--model",
            str(model_dir),
            "--served-model-name",
            MODEL,
            "--port",
            str(port),
            "--device",
            "cpu",
            "--block-size",
            "4",
            "--device-blocks",
            "256",
            "--api-keys-file",
            str(keys_file),
            "--metrics-require-key",
            "--max-body-bytes",
            str(MAX_BODY),
            "--max-prompt-tokens",
            str(MAX_PROMPT),
            "--max-tokens-limit",
            str(MAX_TOKENS),
            "--log-level",
            "warning",
        ]
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30.0)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        with self.log.open("ab") as log:
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env)
        if not wait_for(lambda: not self.alive() or self.healthy(), 120.0) or not self.alive():
            self.__exit__()
            raise RuntimeError(f"kvstore serve did not start:\n{self.log.read_text()[-2000:]}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            if not wait_for(lambda: proc.poll() is not None, 20.0):
                proc.kill()
            proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            return self.client.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def send(self, case: Case) -> int | None:
        """The status of `case`'s request; None when the connection failed or timed out."""
        headers, content = AUTH if case.headers is None else case.headers, case.content
        if content is not None:
            headers = {**headers, "Content-Type": "application/json"}
        if case.chunked and content is not None:
            content = iter([content[i : i + 4096] for i in range(0, len(content), 4096)])
        try:
            method = "GET" if content is None else "POST"
            return self.client.request(
                method, case.path, content=content, headers=headers
            ).status_code
        except httpx.HTTPError:
            return None

    def index(self) -> dict[str, float]:
        """The /metrics series an admitted request moves, and the count of refused ones."""
        text = self.client.get("/metrics", headers=AUTH).text
        values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
        refused = sum(float(v) for k, v in values.items() if k.startswith("kvstore_requests_rej"))
        return {**{k: float(values.get(s, 0)) for k, s in INDEX.items()}, "refused": refused}

    def warm(self) -> int | None:
        """cached_tokens of a valid request for the warm prompt (None if it failed)."""
        r = self.client.post(COMPLETIONS, json={**base(COMPLETIONS), "prompt": WARM}, headers=AUTH)
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] if r.is_success else None
