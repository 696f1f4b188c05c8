"""What a GPU machine with PyTorch and transformers alone needs for `bench gpu`, packed on a
machine with the package index and unpacked there (docs/GPU.md).

`prepare(folder)` writes into the folder:
- `wheels/`: the project's other packages (and `transformers serve`'s) as wheels for the GPU
  machine's Python (3.12 by default), each at the version installed here;
- `bin/redis-server` (a wrapper that runs `bin/redis-server.bin` on the libraries in
  `lib/`: those it links beyond the C runtime; no other process sees them);
- `cache/tokenizers/smollm2/`: the tokenizer `dummy:NAME` models use (engine/model/dummy.py).

`activate(folder)` (on the GPU machine) installs the wheels into `site/` once, without the
index, and returns the environment a run needs: PYTHONPATH, PATH and KVSTORE_CACHE_DIR
pointing there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the project's dependencies but torch and transformers (and what they bring), and those of
# `transformers serve`: carried with everything they require, at the versions here
ROOTS = ("lmdb", "redis", "hiredis", "lz4", "zstandard", "xxhash", "tqdm", "rich", "fastapi",
         "uvicorn", "httpx", "prometheus-client", "pyzmq", "msgspec", "openai", "starlette",
         "pydantic")  # fmt: skip
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip
REDIS_WRAPPER = """#!/bin/sh
here="$(dirname "$0")"
export LD_LIBRARY_PATH="$here/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$here/redis-server.bin" "$@"
"""
# libraries every Linux has: not carried
C_RUNTIME = ("linux-vdso", "libc.so", "libm.so", "libstdc++", "libgcc_s", "ld-linux")


def prepare(folder: Path, python_version: str = "3.12") -> list[str]:
    """Fill `folder` (see the module's docstring); the wheels' file names."""
    wheels = folder / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={version}" for name, version in sorted(closure(ROOTS).items())]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--python-version", python_version, "--implementation", "cp", *platforms,
         "--disable-pip-version-check", "-q", "-d", str(wheels), *pins],
        check=True,
    )  # fmt: skip
    _redis_server(folder)
    _tokenizer(folder)
    return sorted(p.name for p in wheels.glob("*.whl"))


def closure(roots: tuple[str, ...]) -> dict[str, str]:
    """The installed distributions `roots` require, transitively (extras aside): name ->
    version."""
    from packaging.requirements import Requirement

    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in found:
            continue
        dist = metadata.distribution(name)
        found[name] = dist.version
        for line in dist.requires or ():
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def _redis_server(folder: Path) -> None:
    """The redis-server executable and the libraries it links (but the C runtime)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed here: nothing to carry")
    (folder / "bin").mkdir(exist_ok=True)
    (folder / "lib").mkdir(exist_ok=True)
    shutil.copy2(os.path.realpath(binary), folder / "bin" / "redis-server.bin")
    wrapper = folder / "bin" / "redis-server"
    wrapper.write_text(REDIS_WRAPPER)
    wrapper.chmod(0o755)
    linked = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    for line in linked.splitlines():
        parts = line.split("=>")
        if len(parts) != 2 or any(name in parts[0] for name in C_RUNTIME):
            continue
        path = parts[1].split("(")[0].strip()
        if path:
            shutil.copy2(os.path.realpath(path), folder / "lib" / Path(parts[0].strip()).name)


def _tokenizer(folder: Path) -> None:
    from engine.model.dummy import dummy_tokenizer_dir

    target = folder / "cache" / "tokenizers" / "smollm2"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(dummy_tokenizer_dir(), target)


def activate(folder: Path) -> dict[str, str]:
    """Install the carried wheels into `folder/site` (once) and return the environment of
    a run that uses them."""
    folder = folder.resolve()
    site = folder / "site"
    if not (site / ".installed").is_file():
        wheels = sorted(str(p) for p in (folder / "wheels").glob("*.whl"))
        if not wheels:
            raise SystemExit(f"{folder} holds no wheels: fill it with bench gpu --prepare")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--upgrade", "--target", str(site), *wheels],
            check=True,
        )  # fmt: skip
        (site / ".installed").write_text("\n".join(wheels) + "\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    env["PATH"] = os.pathsep.join([str(folder / "bin"), env.get("PATH", "")])
    env["KVSTORE_CACHE_DIR"] = str(folder / "cache")
    return env
