"""Run `python -m <module> ...` (the kvstore CLI, the benchmarks) as a subprocess, optionally
as if some installed modules were not: an import hook in the child refuses them, the way a
missing extra does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# The child: refuse imports of the modules named in argv[1] (comma-separated), then run
# argv[2] as `python -m`, with the remaining arguments.
_RUN_BLOCKED = """
import importlib.abc, runpy, sys

blocked = set(filter(None, sys.argv[1].split(",")))


class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Blocked())
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
