"""The examples in docs/ run as written."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def python_blocks(markdown: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown.read_text(), flags=re.S)


def test_embedding_example_runs_and_prints_the_documented_hits(tmp_path):
    blocks = [b for b in python_blocks(ROOT / "docs" / "EMBEDDING.md") if "load_into" in b]
    assert len(blocks) == 1
    script = tmp_path / "embed.py"
    script.write_text(blocks[0])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["prompt 51 tokens, cached 0", "prompt 50 tokens, cached 48"]


def cited_docs(path: Path) -> set[str]:
    """Markdown files a file cites by name: `docs/X.md`, `X.md`, `(X.md)`."""
    return set(re.findall(r"(?<![\w/.-])((?:docs/)?[A-Z][A-Z_]*\.md)\b", path.read_text()))


def test_code_and_docs_cite_only_docs_that_are_in_the_repository():
    sources = [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")]
    for package in ("hashing", "kvstore", "engine", "bench"):
        sources += (ROOT / package).rglob("*.py")
    cited = {(src, name) for src in sources for name in cited_docs(src)}
    assert "docs/ARCHITECTURE.md" in {name for _, name in cited}
    missing = [
        f"{src.relative_to(ROOT)} cites {name}"
        for src, name in cited
        if not any(p.is_file() for p in (ROOT / name, ROOT / "docs" / name, src.parent / name))
    ]
    assert missing == []
