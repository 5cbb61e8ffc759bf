"""What our hooks assume about SGLang's source (the checks of sglang_patches.source_checks, and the hook targets),
checked without a GPU: the source is parsed with `ast`, nothing of SGLang is imported, so this runs against an
unpacked wheel on any machine.

    python -m sglang_patches.contract                  # the installed sglang
    python -m sglang_patches.contract --source DIR     # an unpacked wheel (DIR contains sglang/)
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import sys
from pathlib import Path

from .hooks import HOOKS
from .source_checks import CHECKS, SourceCheck
from .version import SGLANG_VERSION


# Hook targets whose definition the checks locate (every HookSpec must be covered).
HOOKED_SYMBOLS = {spec.target for spec in HOOKS}

# Hooks on private SGLang names (a component with a leading underscore), with every SGLang version their code was read
# in: nothing public does their job, so a version bump re-reads these first. The rest of our targets are public
# methods, hooked through SGLang's own plugin API (entry point group sglang.srt.plugins + HookRegistry).
PRIVATE_HOOKS: dict[str, tuple[str, ...]] = {
    # The one place SGLang prices a running request's reservation, for admission (PrefillAdder.__init__) and for
    # preemption (preempt_to_schedule): an AFTER on __init__ could not reach the latter. 0.5.15.post1: the pin, its
    # body checked by source_checks; 0.5.23: the same method and callers (ratio 1.0 for ignore_eos requests).
    "sglang.srt.managers.schedule_policy.PrefillAdder._get_running_request_total_token_offset": ("0.5.15.post1",
                                                                                                "0.5.23"),
}


def is_private(target: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in target.split("."))


def private_hooks_listed() -> list[str]:
    """Every private hook target is in PRIVATE_HOOKS with the pinned version among those it was read in."""
    problems = [f"hook target {t}: private, not listed in PRIVATE_HOOKS" for t in sorted(HOOKED_SYMBOLS)
                if is_private(t) and t not in PRIVATE_HOOKS]
    problems += [f"PRIVATE_HOOKS {t}: not a hook target, or not private" for t in sorted(PRIVATE_HOOKS)
                 if t not in HOOKED_SYMBOLS or not is_private(t)]
    problems += [f"PRIVATE_HOOKS {t}: not read in the pinned {SGLANG_VERSION}" for t, versions in
                 sorted(PRIVATE_HOOKS.items()) if SGLANG_VERSION not in versions]
    return problems


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _find(tree: ast.Module, dotted: str) -> ast.AST | None:
    node: ast.AST = tree
    for part in dotted.split("."):
        body = getattr(node, "body", [])
        found = None
        for child in body:
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and child.name == part:
                found = child
        if found is None:
            return None
        node = found
    return node


def defined_names(node: ast.AST) -> set[str]:
    """Names a class (or module) defines: defs, assigned/annotated names in its body, and `self.x = ...`."""
    names: set[str] = set()
    for child in getattr(node, "body", []):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(child.name)
        elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
            names.add(child.target.id)
        elif isinstance(child, ast.Assign):
            names.update(t.id for t in child.targets if isinstance(t, ast.Name))
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        else:
            targets = []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


def run_check(check: SourceCheck, package_dir: Path) -> list[str]:
    """Problems found for one check (empty = it holds)."""
    file = package_dir / check.path
    if not file.is_file():
        return [f"{check.dotted}: file {check.path} is missing ({check.why})"]
    source = file.read_text(encoding="utf-8")
    tree = ast.parse(source)
    node = _find(tree, check.symbol) if check.symbol else tree
    if node is None:
        return [f"{check.dotted}: symbol not found ({check.why})"]
    problems = []
    if check.names:
        missing = sorted(set(check.names) - defined_names(node))
        if missing:
            problems.append(f"{check.dotted}: does not define {missing} ({check.why})")
    segment = _squash((ast.get_source_segment(source, node) or "") if check.symbol else source)
    for snippet in check.snippets:
        if _squash(snippet) not in segment:
            problems.append(f"{check.dotted}: expected code `{snippet}` not found ({check.why})")
    return problems


def hooked_symbols_located(package_dir: Path) -> list[str]:
    """Every hook target resolves to a def/class in the source (what HookRegistry will resolve at start-up)."""
    problems = []
    for target in sorted(HOOKED_SYMBOLS):
        parts = target.split(".")
        for split in range(len(parts) - 1, 0, -1):  # longest module path that is a file
            file = package_dir / Path(*parts[1:split]).with_suffix(".py")
            if file.is_file():
                node = _find(ast.parse(file.read_text(encoding="utf-8")), ".".join(parts[split:]))
                if node is None:
                    problems.append(f"hook target {target}: not defined in {file.relative_to(package_dir)}")
                break
        else:
            problems.append(f"hook target {target}: no module file found")
    return problems


def check_contract(package_dir: Path) -> list[str]:
    """All problems of the pinned-SGLang contract for the `sglang` package directory given."""
    problems = hooked_symbols_located(package_dir) + private_hooks_listed()
    for check in CHECKS:
        problems.extend(run_check(check, package_dir))
    return problems


def installed_package_dir() -> Path:
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sglang is not installed here; pass --source DIR (an unpacked wheel)")
    return Path(list(spec.submodule_search_locations)[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=f"Check SGLang's source against our hooks (pinned {SGLANG_VERSION})")
    parser.add_argument("--source", type=Path, default=None, help="directory that contains the sglang/ package")
    args = parser.parse_args(argv)
    package_dir = args.source / "sglang" if args.source else installed_package_dir()
    problems = check_contract(package_dir)
    for line in problems:
        print("FAIL", line)
    print(f"{len(CHECKS)} checks + {len(HOOKED_SYMBOLS)} hook targets ({len(PRIVATE_HOOKS)} private) against {package_dir}: "
          f"{'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
