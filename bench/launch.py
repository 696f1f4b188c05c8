"""Servers as subprocesses on loopback, for benchmarks and tests: one launcher that starts a
command in its own process group, waits until its /health answers 200 and stops the whole
group (SIGTERM, then SIGKILL), whatever the command is (`kvstore serve`, `transformers serve`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from bench.local_redis import free_port

__all__ = ["ServerProcess", "free_port"]

READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0


class ServerProcess:
    """One server subprocess, its own process group; `url` is its base URL on 127.0.0.1."""

    def __init__(
        self,
        args: list[str],
        port: int,
        log_path: Path,
        env: dict[str, str],
        name: str = "kvstore serve",
        ready_timeout_s: float = READY_TIMEOUT_S,
    ):
        self.args, self.port, self.log_path, self.env = args, port, log_path, env
        self.name, self.ready_timeout_s = name, ready_timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,  # its own group: stop() reaches every child
            )  # fmt: skip
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self) -> ServerProcess:
        """Poll /health until 200; RuntimeError with the log's tail if the process exits or
        `ready_timeout_s` passes first (the process is stopped then)."""
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline and self.alive():
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        why = "exited" if not self.alive() else f"not ready after {self.ready_timeout_s:.0f} s"
        self.stop()
        raise RuntimeError(
            f"{self.name} on port {self.port} did not start ({why}):\n{self.log_tail()}"
        )

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the group, SIGKILL after `timeout_s`; then SIGKILL to any straggler."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)  # children that outlived the leader

    def __enter__(self) -> ServerProcess:
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
