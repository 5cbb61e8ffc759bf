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
    assert {"env", "gpu_tests", "rollout_bench", "megatron_smoke", "megatron_fp32_head"} <= set(names)
    assert all(limit.isdigit() for _, limit in calls), calls
    sglang = {"sglang_contract", "sglang_smoke"}  # only where SGLang imports, never on the device image
    assert sum(int(limit) for name, limit in calls if name not in sglang) <= 480
    assert "timeout --kill-after" in text and "SGLang is not installed" in text
    assert 'carry=[".whl"]' in text  # the device call is written out at the top


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
