"""What the SGLang modules we hook or use import when they load, and what provides each on a CPU machine.

`python -m pytest -m sglang` imports SGLang in the stand-in environment of source.py: the pinned source, a
torchvision stub, and CPU_IMPORT_DEPS installed --no-deps. A module SGLang imports at module level that none of
them provides, and that a fresh `pip install -e ".[test]"` does not install either, fails every SGLang test in a
fresh venv (#45: orjson and IPython) while passing on a machine that happens to have it.

`record()` imports USED_MODULES in a fresh interpreter with the stand-in active and lists every top-level module that
got loaded, with where it came from: "deps" (CPU_IMPORT_DEPS, with its distribution), "stub", or "env" (this
environment, with its distribution). MANIFEST stores that for the pinned version; tests/sglang/test_stand_in.py
checks in the default run that every "deps" distribution is in CPU_IMPORT_DEPS and every "env" one is a requirement
of the project (what a fresh venv has), and, with `-m sglang`, that MANIFEST is still what record() finds.

    python -m sglang_patches.import_audit --write     # regenerate MANIFEST (builds the stand-in under .cache once)
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

from .hooks import HOOKS
from .version import SGLANG_VERSION

MANIFEST = Path(__file__).with_name("sglang_imports.json")
# What the plugin and its tests import besides the hooked modules (tests/helpers/sglang_pools.py, tests/sglang/)
IMPORTED = (
    "sglang", "sglang.srt.plugins.hook_registry", "sglang.srt.runtime_context", "sglang.srt.constants",
    "sglang.srt.managers.schedule_batch", "sglang.srt.managers.schedule_policy", "sglang.srt.sampling.sampling_params",
    "sglang.srt.mem_cache.allocator.token", "sglang.srt.mem_cache.cache_init_params", "sglang.srt.mem_cache.chunk_cache",
    "sglang.srt.mem_cache.memory_pool", "sglang.srt.speculative.spec_info", "sglang.srt.layers.radix_attention",
    "sglang.srt.utils.torch_memory_saver_adapter",
)


def hooked_modules(source: Path) -> list[str]:
    """The module of each hook target (`a.b.Class.method` -> `a.b`): its longest prefix that is a module of the
    source tree."""
    out = []
    for spec in HOOKS:
        parts = spec.target.split(".")
        for n in range(len(parts), 0, -1):
            path = source.joinpath(*parts[:n])
            if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
                out.append(".".join(parts[:n]))
                break
    return out


def used_modules(source: Path) -> list[str]:
    return sorted(set(IMPORTED) | set(hooked_modules(source)))


_RECORD = r'''
import importlib, importlib.metadata as md, json, os, re, sys
source, stubs, deps, allowed, unhidden = sys.argv[1:6]
modules = sys.argv[6:]
allowed, unhidden = set(allowed.split(",")), set(unhidden.split(","))
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
dep_dists = {}  # top-level module -> distribution, for what CPU_IMPORT_DEPS installed
for info in os.listdir(deps):
    if info.endswith(".dist-info"):
        dist = md.Distribution.at(os.path.join(deps, info))
        for f in dist.files or ():
            top = f.parts[0].removesuffix(".py")
            if not top.endswith((".dist-info", ".data")) and top not in ("..", "__pycache__"):
                dep_dists.setdefault(top, dist.metadata["Name"])
stubbed = set(os.listdir(stubs))
by_module = md.packages_distributions()
project = {"slime_sparse", "sglang_patches"}
hidden = sorted(m for m, dists in by_module.items() if not any(norm(d) in allowed for d in dists)
                and m not in sys.stdlib_module_names | project | set(dep_dists) | stubbed | unhidden)
for name in hidden:
    sys.modules[name] = None  # as in a fresh venv with the project and its test extra only
from sglang_patches.source import activate_cpu_import_env
activate_cpu_import_env([source, stubs, deps])
for name in modules:
    try:
        importlib.import_module(name)
    except ImportError as exc:  # a module nothing provides: named, so that the caller can find the next one
        missing = re.search(r"No module named '([^'.]+)|import of ([^.\s]+)", str(exc))
        print("MISSING " + (missing.group(1) or missing.group(2) if missing else repr(exc)))
        raise
found = {}
for name in sorted({n.split(".")[0] for n in sys.modules}):
    mod = sys.modules.get(name)
    where = getattr(mod, "__file__", None) or next(iter(getattr(mod, "__path__", []) or []), None)
    if name in sys.stdlib_module_names or where is None or name in project or name == "sglang":
        continue
    if name.endswith("__mypyc"):  # a compiled wheel's runtime, named by its build's hash: no import of SGLang's
        continue
    where = os.path.realpath(where)
    if where.startswith(os.path.realpath(deps) + os.sep):
        found[name] = {"from": "deps", "dist": dep_dists.get(name, "?")}
    elif where.startswith(os.path.realpath(stubs) + os.sep):
        found[name] = {"from": "stub"}
    elif by_module.get(name):
        found[name] = {"from": "env", "dist": by_module[name][0]}
print("HIDDEN %d" % len(hidden))
print("RECORD " + json.dumps(found, sort_keys=True))
'''


def setup_requirements(extras: tuple[str, ...] = ("test",)) -> list[str]:
    """The requirements setup.py declares (BASE) and its `extras` add, read from its source (nothing runs)."""
    from .source import REPO_ROOT

    tree = ast.parse((REPO_ROOT / "setup.py").read_text(encoding="utf-8"))
    nodes = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Name) and t.id in ("BASE", "EXTRAS")}
    extra_nodes = {ast.literal_eval(k): v for k, v in zip(nodes["EXTRAS"].keys, nodes["EXTRAS"].values)}
    return ast.literal_eval(nodes["BASE"]) + [r for e in extras for r in ast.literal_eval(extra_nodes[e])]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def with_dependencies(names: list[str] | set[str]) -> set[str]:
    """`names` (requirement strings: extras count) and, transitively, what their installed versions require, with
    the extras asked for (datasets needs `fsspec[http]`, hence aiohttp): what `pip install` of them brings into a
    fresh venv."""
    from importlib import metadata

    out, seen, todo = set(), set(), [Requirement(n) for n in names]
    while todo:
        req = todo.pop()
        name, extras = normalize(req.name), tuple(sorted(req.extras))
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        out.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            dep = Requirement(text)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in ("", *extras)):
                todo.append(dep)
    return out


def record(paths: list[Path] | None = None) -> tuple[dict[str, dict[str, str]], int]:
    """({top-level module: {"from": "deps" | "stub" | "env", "dist": distribution}}, modules hidden) of what importing
    `used_modules` loads in a fresh interpreter that sees, besides the stand-in (paths: prepare_cpu_import_env's,
    built if not given), only the project's requirements and its test extra, as a fresh venv would. A module none of
    them provides fails the import, naming it."""
    from .source import REPO_ROOT, prepare_cpu_import_env

    source, stubs, deps = paths or prepare_cpu_import_env()
    allowed = ",".join(sorted(with_dependencies(setup_requirements())))
    missing: list[str] = []
    while True:  # each missing module is unhidden in turn, so that one call names all of them
        proc = subprocess.run([sys.executable, "-c", _RECORD, str(source), str(stubs), str(deps), allowed,
                               ",".join(missing), *used_modules(Path(source))], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=3600, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RECORD ")), None)
        gap = next((x.split()[1] for x in proc.stdout.splitlines() if x.startswith("MISSING ")), None)
        if line is None and gap and gap not in missing and len(missing) < 40:
            missing.append(gap)
            continue
        break
    if missing or proc.returncode or line is None:
        raise RuntimeError(f"SGLang imports modules that neither the stand-in (CPU_IMPORT_DEPS, stubs) nor the "
                           f"project's requirements provide: {missing or 'see below'}; add their distributions to "
                           f"sglang_patches/source.py CPU_IMPORT_DEPS\n{proc.stderr[-3000:] if line is None else ''}")
    hidden = int(re.search(r"HIDDEN (\d+)", proc.stdout).group(1))
    return json.loads(line.removeprefix("RECORD ")), hidden


def uncovered(modules: dict[str, dict[str, str]], deps: tuple[str, ...], stubs: tuple[str, ...],
              allowed: set[str]) -> list[str]:
    """What of a recorded import list a fresh venv + the stand-in would lack: a "deps" module whose distribution
    is not in `deps` (CPU_IMPORT_DEPS pins), a "stub" not in `stubs`, an "env" one outside `allowed` (the project's
    requirements and what they pull)."""
    pinned = {normalize(d.split("==")[0]) for d in deps}
    out = []
    for module, info in sorted(modules.items()):
        where, dist = info["from"], normalize(info.get("dist", "?"))
        if (where == "deps" and dist not in pinned) or (where == "stub" and module not in stubs) or \
                (where == "env" and dist not in allowed):
            out.append(f"{module} ({where}: {info.get('dist', 'a stub')})")
    return out


def manifest_text(found: dict[str, dict[str, str]]) -> str:
    return json.dumps({"sglang": SGLANG_VERSION, "extras": ["test"], "modules": found}, indent=1,
                      sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    found, _hidden = record()
    text = manifest_text(found)
    if "--write" in (argv if argv is not None else sys.argv[1:]):
        MANIFEST.write_text(text)
        print(f"wrote {MANIFEST}: {len(found)} top-level modules")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
