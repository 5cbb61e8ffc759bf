"""The shape of the house (docs/architecture.md, "Dependency rules"), read from the source with `ast`: which of our packages each layer
may import. Every import counts, at module level or inside a function (a lazy import is still a dependency)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def our_imports(path: Path, source: str | None = None) -> set[str]:
    """Absolute names of the slime_sparse / sglang_patches modules that `path` imports (relative ones resolved);
    `source`: the module's text, if not the file's."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    text = path.read_text(encoding="utf-8") if source is None else source
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.split(".")[0] in ("slime_sparse", "sglang_patches")}


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def offenders(folder: str, forbidden) -> dict[str, list[str]]:
    found = {}
    for path in modules(folder):
        bad = sorted(n for n in our_imports(path) if forbidden(n))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_no_rollout_engine_imports_the_orchestrator():
    assert modules("slime_sparse/rollout")
    assert offenders("slime_sparse/rollout", lambda n: n == "slime_sparse.ray" or n.startswith("slime_sparse.ray.")) == {}


ENGINES = ("slime_sparse/rollout/embedded", "slime_sparse/rollout/sglang", "slime_sparse/rollout/base.py",
           "slime_sparse/rollout/sampling.py", "slime_sparse/rollout/offload.py")


def test_engines_and_learners_meet_only_in_the_rollout_function_and_pipeline():
    """Engines never import learners (nor the rollout function or the pipeline above them); learners import nothing
    of `rollout/`. They meet in rollout/sparse_rollout.py and rollout/pipeline.py, which sit above both."""
    above = ("slime_sparse.backends", "slime_sparse.rollout.pipeline", "slime_sparse.rollout.sparse_rollout",
             "slime_sparse.rollout.filter_hub")
    paths = [p for e in ENGINES for p in ([ROOT / e] if e.endswith(".py") else modules(e))]
    assert len(paths) > 5
    bad = {str(p.relative_to(ROOT)): sorted(n for n in our_imports(p) if any(n == a or n.startswith(a + ".")
                                                                              for a in above)) for p in paths}
    assert {p: names for p, names in bad.items() if names} == {}
    assert offenders("slime_sparse/backends", lambda n: n == "slime_sparse.rollout"
                     or n.startswith("slime_sparse.rollout.")) == {}


@pytest.mark.parametrize("folder,allowed", [
    # the preset mechanism and the model's shape sit below kv/ (and algo/, which shares the presets)
    ("slime_sparse/kv", ("slime_sparse.kv", "slime_sparse.utils.presets", "slime_sparse.utils.model_shape")),
    ("slime_sparse/utils/presets.py", ()),
    ("slime_sparse/utils/model_shape.py", ()),
    ("slime_sparse/planner", ("slime_sparse.planner", "slime_sparse.kv", "slime_sparse.utils.model_shape")),
    ("slime_sparse/eval/modes.py", ("slime_sparse.kv", "slime_sparse.types", "slime_sparse.data")),  # no CLI
    ("sglang_patches", ("sglang_patches", "slime_sparse.kv")),
    ("slime_sparse/utils/weight_sync.py", ()),
    ("slime_sparse/drift/stats.py", ()),  # the drift guard's statistics and budget rule: pure, read alone
    ("slime_sparse/drift/budget.py", ("slime_sparse.drift.stats",)),
])
def test_lower_layers_import_only_below(folder, allowed):
    paths = [ROOT / folder] if folder.endswith(".py") else modules(folder)
    bad = {str(p.relative_to(ROOT)): sorted(n for n in our_imports(p)
                                            if not any(n == a or n.startswith(a + ".") for a in allowed))
           for p in paths}
    assert {p: names for p, names in bad.items() if names} == {}


def test_the_checker_sees_relative_and_lazy_imports():
    """The check above can fail: a relative import two levels up and an import inside a function are both found."""
    probe = ROOT / "slime_sparse" / "rollout" / "sglang" / "probe.py"  # never written: its text is given
    text = "def f():\n    from ...ray import placement\n    import slime_sparse.ray.layout\nfrom .config import X\n"
    assert our_imports(probe, text) == {"slime_sparse.ray", "slime_sparse.ray.placement", "slime_sparse.ray.layout",
                                        "slime_sparse.rollout.sglang.config", "slime_sparse.rollout.sglang.config.X"}


def test_only_the_eval_command_imports_its_cli():
    """The evaluation library (slime_sparse/eval/modes.py) is what the loop and components use; its command line
    (cli.py) is imported by `python -m slime_sparse.eval` alone."""
    found = offenders("slime_sparse", lambda n: n == "slime_sparse.eval.cli" or n.startswith("slime_sparse.eval.cli."))
    assert found == {"slime_sparse/eval/__main__.py": ["slime_sparse.eval.cli", "slime_sparse.eval.cli.main"]}
