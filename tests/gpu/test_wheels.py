"""The wheels carried to the device machine (tools/gpu_wheels.txt) plus its image's packages
(tools/gpu_image_packages.txt) cover every import of what tools/gpu_checks.sh runs through the training loop.

A subprocess hides every installed distribution that is neither on the image nor in the wheel list (its top-level
modules set to None in sys.modules: `import x` fails as on the image, and `importlib.util.find_spec` says absent,
so optional imports take the same branch as there), then runs the tiny recipe for one rollout with the embedded
and the Megatron learner and the RL-step benchmark for one step: lazy imports (datasets when the data loads, the
plots, the checkpoint writer) are reached, not only the module imports. A module missing on the image fails here,
not on the GPU (#34: `import datasets`)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

# the image's packages with what they require: the same closure as the SGLang stand-in's fresh venv
from sglang_patches.import_audit import normalize, with_dependencies

ROOT = Path(__file__).resolve().parents[2]

RUN = r'''
import importlib.metadata as md, re, sys, sysconfig
allowed = set(sys.argv[1].split(","))
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
project = {"slime_sparse", "sglang_patches"}  # from the checkout, as on the device machine
hidden = sorted(m for m, dists in md.packages_distributions().items()
                if not any(norm(d) in allowed for d in dists) and m not in sys.stdlib_module_names | project)
for name in hidden:
    sys.modules[name] = None  # as if not installed
print("hidden:", len(hidden), "modules", flush=True)

sys.path.insert(0, "examples/tiny_cpu")
import run
from slime_sparse.tasks.assets import AssetsConfig
from slime_sparse.tasks.repeated_add import RepeatedAddConfig
from slime_sparse.tasks.tiny_model import TinyModelConfig
from slime_sparse.tasks.warm_start import WarmStartConfig

micro = AssetsConfig(task=RepeatedAddConfig(min_count=2, max_count=3),
                     model=TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                           intermediate_size=64, max_position_embeddings=128),
                     warm_start=WarmStartConfig(steps=2, batch_size=4), n_train=16, n_test=4)
flags = ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
         "--rollout-max-response-len", "16", "--kv-budget", "8", "--kv-buffer", "4", "--kv-window", "2",
         "--eval-max-prompts", "2", "--no-progress-bar"]
tmp = sys.argv[2]
for name, extra in (("embedded", []), ("megatron", ["--train-backend", "megatron"])):
    assert run.main(["--cache-dir", tmp + "/assets", "--run-dir", f"{tmp}/{name}", "--", *flags, *extra],
                    assets_config=micro) == 0, name
sys.path.insert(0, "benchmarks")
import rl_step_bench
rl_step_bench.main(["--shape", "tiny", "--device", "cpu", "--steps", "1", "--modes", "sparse", "--response-len", "32",
                    "--cache-dir", tmp + "/bench"])
import runpy
sys.argv = ["gpu_summary.py", tmp]
(Path := __import__("pathlib").Path)(tmp, "steps.tsv").write_text("")
runpy.run_path("tools/gpu_summary.py", run_name="__main__")
print("TRAINING PATH OK")
'''


def requirement_names(path: Path) -> set[str]:
    """Distribution names of a list file: one per whitespace-separated word, `name==version` pins, # comments."""
    names = set()
    for line in path.read_text().splitlines():
        for word in line.split("#", 1)[0].split():
            names.add(normalize(word.split("==")[0]))
    return names


def test_the_wheel_list_is_pinned_and_fetched_as_listed():
    wheels = [line.split("#", 1)[0].strip() for line in (ROOT / "tools/gpu_wheels.txt").read_text().splitlines()]
    wheels = [w for w in wheels if w]
    assert wheels and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", w) for w in wheels), wheels
    image = requirement_names(ROOT / "tools/gpu_image_packages.txt")
    assert {"torch", "transformers", "triton", "numpy", "pyarrow"} <= image
    assert not requirement_names(ROOT / "tools/gpu_wheels.txt") & image  # a second version would break the install
    assert "tools/gpu_wheels.txt" in (ROOT / "tools/fetch_gpu_wheels.sh").read_text()


@pytest.mark.megatron
def test_the_training_path_imports_only_the_image_and_the_wheels(tmp_path):
    pytest.importorskip("megatron.core")
    # the wheels are installed without their dependencies: what they need must be on the image
    allowed = with_dependencies(requirement_names(ROOT / "tools/gpu_image_packages.txt")) \
        | requirement_names(ROOT / "tools/gpu_wheels.txt")
    proc = subprocess.run([sys.executable, "-c", RUN, ",".join(sorted(allowed)), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                               "OMP_NUM_THREADS": "1"})
    missing = re.findall(r"No module named '([^']+)'|import of (\S+) halted", proc.stderr)
    assert proc.returncode == 0 and "TRAINING PATH OK" in proc.stdout, (missing, proc.stderr[-3000:])
    assert re.search(r"hidden: [1-9]\d* modules", proc.stdout)  # the check can fail: something was hidden


def test_hiding_a_distribution_fails_its_import(tmp_path):
    """The subprocess's blocker does hide what is not allowed: without datasets in the list, loading data fails
    with the error the GPU run met."""
    script = RUN.split("sys.path.insert", 1)[0] + "import datasets\n"
    allowed = requirement_names(ROOT / "tools/gpu_image_packages.txt")
    proc = subprocess.run([sys.executable, "-c", script, ",".join(sorted(allowed)), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"})
    assert proc.returncode != 0 and "datasets" in proc.stderr
