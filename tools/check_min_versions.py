"""Install the lowest versions setup.py declares into a fresh virtual environment and run the engine and loop
tests there: what `pip install` may give a user must run.

    python tools/check_min_versions.py                 # venv under .cache/min-versions, then pytest
    python tools/check_min_versions.py --list          # only print the pins it would install

Every requirement of setup.py's BASE list is pinned to its lower bound (`name>=X` -> `name==X`); their own
dependencies resolve as pip resolves them today. torch is the exception: it is pinned to the build installed
here (the only CPU build this machine can install), so torch's lower bound is not what this checks.
Needs the package registry; takes minutes. Exit status: pytest's.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the transformers surface the engine uses, the engine against dense attention and HF generate, the data loader,
# the grader, whole runs
TESTS = ["tests/rollout/embedded/test_transformers_contract.py", "tests/rollout/embedded/test_cache.py",
         "tests/rollout/embedded/test_engine.py", "tests/data/test_prompt_dataset.py", "tests/reward/test_math_grader.py",
         "tests/backends/embedded/test_learner.py", "tests/e2e/test_train.py"]
TEST_TOOLS = ["pytest>=8.0", "pytest-timeout>=2.3"]


def declared_requirements(setup_py: Path = ROOT / "setup.py") -> list[str]:
    """The BASE list of setup.py, read without running it."""
    for node in ast.walk(ast.parse(setup_py.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "BASE" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise RuntimeError(f"{setup_py}: no BASE = [...] list")


def lowest_pins(requirements: list[str], torch_version: str) -> list[str]:
    """`name==lower bound` for each requirement; torch at `torch_version`."""
    pins = []
    for req in requirements:
        name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0)
        if name == "torch":
            pins.append(f"torch=={torch_version}")
            continue
        low = re.search(r">=\s*([^,;\s]+)", req)
        if low is None:
            raise RuntimeError(f"setup.py requirement {req!r} has no lower bound")
        pins.append(f"{name}=={low.group(1)}")
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default=str(ROOT / ".cache" / "min-versions"), help="where the venv is made")
    parser.add_argument("--list", action="store_true", help="print the pins and stop")
    args, pytest_args = parser.parse_known_args(argv)
    import torch

    pins = lowest_pins(declared_requirements(), torch.__version__)
    print("pins:", " ".join(pins), flush=True)
    if args.list:
        return 0
    venv.create(args.venv, with_pip=True, clear=True)
    py = str(Path(args.venv) / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + pins + TEST_TOOLS, check=True)
    subprocess.run(pip + ["--no-deps", "-e", str(ROOT)], check=True)  # our code, with nothing else upgraded
    subprocess.run([py, "-m", "pip", "list", "--format=freeze"], check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, *pytest_args],
                          cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
