"""The repository is self-contained: no file points outside it, and every Markdown file a file names exists."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".md", ".sh", ".ini", ".txt", ".yaml", ".yml", ".toml", ".cfg", ".json"}
SKIP_DIRS = {".git", ".cache", "runs", "__pycache__", ".pytest_cache", "build", "dist", ".whl", "reports", "outputs"}
# where our own files live: a Markdown path under one of these, or a bare file name, must resolve
OURS = ("docs/", "examples/", "benchmarks/", "slime_sparse/", "sglang_patches/", "tools/", "tests/")
MD_PATH = re.compile(r"(?<![\w./-])((?:\.\./|\./)?[\w./-]*\.md)\b")


def text_files() -> list[Path]:
    out = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name in (".gitignore",)):
            out.append(path)
    return out


def test_the_scan_sees_the_repository():
    names = {p.relative_to(ROOT).as_posix() for p in text_files()}
    assert {"README.md", "docs/algorithm.md", "slime_sparse/train.py", "tests/docs/test_docs.py"} <= names


def test_no_file_points_outside_the_repository():
    outside = ["../" + "shared", "/" + "work/"]  # split: this file must not match itself
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}" for p in text_files()
             for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if any(o in line for o in outside)]
    assert found == []


def ours(name: str) -> bool:
    """A bare file name, a relative one, or one under our folders (not another project's `a/b/c.md`)."""
    bare = name.lstrip("./")
    return "/" not in bare or bare.startswith(OURS) or name.startswith("../")


def resolves(name: str, where: Path) -> bool:
    return (ROOT / name).is_file() or (where.parent / name).is_file()


def test_every_markdown_file_named_exists():
    """`docs/algorithm.md`, `README.md`, `../README.md`: each one a file names is in the repository (so the notes
    that used to live outside it, `design.md`, cannot be pointed to)."""
    missing = []
    for path in text_files():
        if path == Path(__file__).resolve():  # its examples below are meant not to resolve
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for name in MD_PATH.findall(line):
                if ours(name) and not resolves(name, path):
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {name}")
    assert missing == []


@pytest.mark.parametrize("line, bad", [
    ("see design.md section 2", True),
    ("see `docs/algorithm.md`", False),
    ("see docs/nothing_here.md", True),
    ("[index](../README.md)", False),
    ("R-KV's SGLang/docs/OPTIMIZATIONS.md", False),  # another project's file
])
def test_the_check_can_fail(line, bad):
    where = ROOT / "docs" / "README.md"
    assert any(ours(n) and not resolves(n, where) for n in MD_PATH.findall(line)) == bad


def test_every_source_file_the_docs_name_exists():
    """A module, tool or test a Markdown file names by path (`slime_sparse/algo/loss.py`) is there: a rename or a
    split elsewhere must carry the docs along. CHANGELOG.md is history: it names files as they were."""
    pattern = re.compile(r"(?<![\w./-])((?:slime_sparse|sglang_patches|tools|tests|benchmarks|examples)/[\w/.-]+"
                         r"\.(?:py|sh))")
    missing = [f"{p.relative_to(ROOT)}: {name}" for p in text_files() if p.suffix == ".md" and p.name != "CHANGELOG.md"
               for name in pattern.findall(p.read_text(encoding="utf-8")) if not (ROOT / name).is_file()]
    assert missing == []
