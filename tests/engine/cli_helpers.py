"""Run `python -m <module> ...` (the kvstore CLI, the benchmarks) as a subprocess, optionally
as if some installed modules were not, the way a missing extra leaves them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# The child: the modules named in argv[1] (comma-separated) read as not installed (None in
# sys.modules: `import` raises ModuleNotFoundError, importlib.util.find_spec answers None),
# then argv[2] runs as `python -m`, with the remaining arguments.
_RUN_BLOCKED = """
import runpy, sys

for name in filter(None, sys.argv[1].split(",")):
    sys.modules[name] = None
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def run_module(
    module: str, *argv: str, blocked: tuple[str, ...] = (), cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m module argv...` with `blocked` modules missing; never raises on its exit."""
    cmd = [sys.executable, "-c", _RUN_BLOCKED, ",".join(blocked), module, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd)


def kvstore(*argv: str, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return run_module("engine.cli", *argv, blocked=blocked)


def only_error_line(proc: subprocess.CompletedProcess[str], prefix: str) -> str:
    """The one line a failed command printed: exit 2, no traceback, `prefix: error: ...`."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{prefix}: error: "), lines[0]
    return lines[0].removeprefix(f"{prefix}: error: ")
