"""tools/gpu_checks.sh (run on the device machine) and its summary table, checked without a GPU."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
SCRIPT = TOOLS / "gpu_checks.sh"


def _summary_module():
    spec = importlib.util.spec_from_file_location("gpu_summary", TOOLS / "gpu_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_step_has_an_explicit_timeout_and_the_run_fits_eight_minutes():
    text = SCRIPT.read_text()
    calls = re.findall(r"^(?:\S+=\S+ )?step (\w+) (\S+) ", text, flags=re.M)
    names = [name for name, _ in calls]
    assert {"env", "gpu_tests", "rollout_bench", "megatron_smoke", "train_tiny", "train_tiny_megatron",
            "rl_step_bench"} <= set(names)
    assert int(dict(calls)["rl_step_bench"]) <= 150 and int(dict(calls)["rollout_bench"]) <= 240
    assert all(limit.isdigit() for _, limit in calls), calls
    sglang = {"sglang_contract", "sglang_smoke"}  # only where SGLang imports, never on the device image
    assert sum(int(limit) for name, limit in calls if name not in sglang) <= 480
    assert "timeout --kill-after" in text and "SGLang is not installed" in text
    assert 'carry=[".whl", ".cache/tiny_assets"]' in text  # the device call is written out at the top
    assert "--device cuda" in text and "--train-backend megatron" in text  # the loop on CUDA, both learners


def test_summary_table_holds_the_figures_of_every_step(tmp_path):
    rows = [("env", "0", "3", "30"), ("gpu_tests", "1", "80", "150"), ("rollout_bench", "124", "110", "110"),
            ("megatron_smoke", "0", "60", "100")]
    (tmp_path / "steps.tsv").write_text("".join("\t".join(r) + "\n" for r in rows)
                                        + "sglang\tskipped\t0\t0\tnot installable here\n")
    (tmp_path / "env.log").write_text("GPU 0: NVIDIA H100 80GB HBM3\npython 3.12.3 torch 2.11.0+cu130 cuda 13.0\n"
                                      "import megatron.core yes\nimport apex no\n")
    (tmp_path / "gpu_tests.log").write_text("FAILED tests/test_gpu_exactness.py::test_x - assert 0.2 < 0.001\n"
                                            "== 1 failed, 9 passed in 40.1s ==\n")
    (tmp_path / "gpu_report.jsonl").write_text(json.dumps({"check": "bf16 dense numeric part", "head": "fp32",
                                                           "mean_abs": 0.0123456, "vetoed_seqs": 0}) + "\n")
    (tmp_path / "rollout_bench.log").write_text(
        "| model | batch | prompt | new | engine | KV | tok/s | x hf | x before | peak KV MiB | compress % "
        "| roofline % | prefill saved | = before |\n"
        "| qwen2-19m | 64 | 128 | 1024 | after | rkv 512 | 5123.4 | 1.90 | - | 40.0 | 3.1 | 12.0 | 0 | - |\n"
        "| model | prompt | new | KV memory GiB | KV | slots per sequence | sequences that fit | x dense |\n"
        "| qwen2.5-1.5b | 128 | 4096 | 16 | rkv B=512+128 | 640 | 936 | 6.64 |\n")
    (tmp_path / "megatron_smoke.log").write_text(
        "TP=1 PP=1: local layer spec (no Transformer Engine); fusions on: bias_activation_fusion\n"
        "TP=1 PP=1 step 4: loss +0.42653 grad_norm 3.2088 recompute 0.1s train 0.2s (80000 tok/s)\n"
        "TP=1 PP=1: exported 50 HF tensors\n")
    table = _summary_module().summary(tmp_path)
    for expected in ("NVIDIA H100", "megatron.core yes", "1 failed, 9 passed", "FAILED tests/test_gpu_exactness.py",
                     "bf16 dense numeric part: head fp32, mean_abs 0.0123", "TIMEOUT (110 s)",
                     "qwen2-19m 64 x 128+1024 after rkv 512: 5123.4 tok/s (x hf 1.90)", "compress 3.1 %",
                     "in 16 GiB of KV, rkv B=512+128: 936 sequences (x dense 6.64)", "grad_norm 3.2088",
                     "exported 50 HF tensors", "fusions on: bias_activation_fusion", "not installable here"):
        assert expected in table, expected
    assert re.search(r"^gpu_tests\s+FAILED \(exit 1\)", table, flags=re.M)


def test_summary_reads_the_training_runs_and_the_rl_step_benchmark(tmp_path):
    rows = [("train_tiny", "0", "31", "40"), ("train_tiny_megatron", "1", "12", "40"), ("rl_step_bench", "124", "75", "75")]
    (tmp_path / "steps.tsv").write_text("".join("\t".join(r) + "\n" for r in rows))
    (tmp_path / "train_tiny.log").write_text(
        "Sparse-RL tiny run (sparse_rl), 9s of training (9s CPU), 30s in all\n\n"
        "metric                                         start       end    change\n"
        "eval accuracy, dense inference (greedy)        0.266     0.922    +0.656\n"
        "KV token savings                               0.466     0.471    +0.005\n")
    (tmp_path / "train_tiny_megatron.log").write_text("Traceback (most recent call last):\n"
                                                      "ModuleNotFoundError: No module named 'datasets'\n")
    bench = ("| dense | 35 | 20.112 | 17.500 | 0.010 | 0.500 | 1.800 | 0.100 | 0.020 | 0.182 | 3746 | 40000 | 38.1 |\n"
             "| dense | rollout | 9000.0 | 9500.0 | 1.06 |\n"
             "| whole step | 20.112 | 11.000 | 1.83 |\n")
    (tmp_path / "rl_step_bench.log").write_text("# sparse step 1/2: 11.00 s (rollout 8.0, ...)\n" + bench)
    table = _summary_module().summary(tmp_path)
    for expected in ("eval accuracy, dense inference (greedy) 0.266 0.922 +0.656", "Sparse-RL tiny run",
                     "No module named 'datasets'", "dense (35 rows at once): step 20.112 s = rollout 17.500",
                     "MFU 38.1 %", "dense rollout: peak 9000.0 MiB, planner 9500.0 MiB (1.06)",
                     "whole step: dense 20.112 s / sparse 11.000 s = 1.83x"):
        assert expected in table, expected
    assert re.search(r"^rl_step_bench\s+TIMEOUT \(75 s\)", table, flags=re.M)
    (tmp_path / "rl_step_bench.log").write_text("# sparse step 1/2: 11.00 s (rollout 8.0, ...)\n")  # cut short
    assert "sparse step 1/2: 11.00 s" in _summary_module().summary(tmp_path)


def test_summary_help_and_a_wrong_directory():
    import sys

    out = subprocess.run([sys.executable, str(TOOLS / "gpu_summary.py"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("usage:") and "OUT" in out.stdout
    bad = subprocess.run([sys.executable, str(TOOLS / "gpu_summary.py"), "/nonexistent"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "no steps.tsv" in bad.stderr and "Traceback" not in bad.stderr
