"""tools/gpu_checks.sh (run on the device machine) and its summary table, checked without a GPU."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
SCRIPT = TOOLS / "gpu_checks.sh"


def _summary_module():
    spec = importlib.util.spec_from_file_location("gpu_summary", TOOLS / "gpu_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def profiles() -> dict[str, list[tuple[str, int]]]:
    """Per profile of the script, its steps (name, timeout) in order, env_step's included."""
    text = SCRIPT.read_text()
    bodies = dict(re.findall(r"^(\w+)\(\) \{[^\n]*\n(.*?)^\}", text, flags=re.M | re.S))
    steps = {name: [(n, int(t)) for n, t in re.findall(r"^\s*(?:\S+=\S+ )?step (\w+) (\d+) ", body, flags=re.M)]
             for name, body in bodies.items()}
    return {name.removeprefix("profile_"): [s for line in body.splitlines() if line.strip() == "env_step"
                                            for s in steps["env_step"]] + steps[name]
            for name, body in bodies.items() if name.startswith("profile_")}


def test_every_step_has_an_explicit_timeout_and_each_profile_fits_eight_minutes():
    text = SCRIPT.read_text()
    found = profiles()
    assert set(found) == {"all", "targets", "rl_step_dense", "rl_step_sparse"}
    names = {name for name, _ in found["all"]}
    assert {"env", "gpu_tests", "rollout_bench", "megatron_smoke", "train_tiny", "train_tiny_megatron",
            "rl_step_bench"} <= names
    limits = dict(found["all"])
    assert limits["rl_step_bench"] <= 150 and limits["rollout_bench"] <= 240
    hooks = int(re.search(r"^HOOK_BUDGET=(\d+)", text, flags=re.M).group(1))
    sglang = {"sglang_contract", "sglang_smoke"}  # only where SGLang imports, never on the device image
    assert sum(t for n, t in found["all"] if n not in sglang) + hooks <= 480
    for profile in ("targets", "rl_step_dense", "rl_step_sparse"):
        assert sum(t for _, t in found[profile]) <= 480, profile
    assert [n for n, _ in found["targets"]] == ["env", "rollout_batch", "rollout_memory"]
    assert "timeout --kill-after" in text and "SGLang is not installed" in text
    assert 'carry=[".whl", ".cache/tiny_assets"]' in text  # the device call is written out at the top
    assert "--device cuda" in text and "--train-backend megatron" in text  # the loop on CUDA, both learners
    assert "tests/gpu/test_offload.py" in text  # the offloaded engine's captures over two steps


def test_summary_table_holds_the_figures_of_every_step(tmp_path):
    rows = [("env", "0", "3", "30"), ("gpu_tests", "1", "80", "150"), ("rollout_bench", "124", "110", "110"),
            ("megatron_smoke", "0", "60", "100")]
    (tmp_path / "steps.tsv").write_text("".join("\t".join(r) + "\n" for r in rows)
                                        + "sglang\tskipped\t0\t0\tnot installable here\n")
    (tmp_path / "env.log").write_text("GPU 0: NVIDIA H100 80GB HBM3\npython 3.12.3 torch 2.11.0+cu130 cuda 13.0\n"
                                      "import megatron.core yes\nimport apex no\n")
    (tmp_path / "gpu_tests.log").write_text("FAILED tests/gpu/test_exactness.py::test_x - assert 0.2 < 0.001\n"
                                            "== 1 failed, 9 passed in 40.1s ==\n")
    (tmp_path / "gpu_report.jsonl").write_text(json.dumps({"check": "bf16 dense numeric part", "head": "fp32",
                                                           "mean_abs": 0.0123456, "vetoed_seqs": 0}) + "\n")
    (tmp_path / "rollout_bench.log").write_text(
        "| model | batch | prompt | new | engine | KV | tok/s | x hf | x before | peak KV MiB | compress % "
        "| roofline % | prefill saved | = before |\n"
        "| qwen2-19m | 64 | 128 | 1024 | after | rkv 512 | 5123.4 | 1.90 | - | 40.0 | 3.1 | 12.0 | 0 | - | 0 |\n"
        "| model | prompt | new | memory GiB | KV | slots per sequence | sequences that fit | x dense |\n"
        "| qwen2.5-1.5b | 128 | 4096 | 16 | rkv B=512+128 | 640 | 936 | 6.64 |\n"
        "| qwen2.5-1.5b | 128 | 4096 | 24 | rkv B=512+128 | mix | 512 | 512 | 1366 | 61000.0 | 2.40 | 1.5 | 0 "
        "| 9.6 | 10.1 | 11.0 |\n")
    (tmp_path / "megatron_smoke.log").write_text(
        "TP=1 PP=1: local layer spec (no Transformer Engine); fusions on: bias_activation_fusion\n"
        "TP=1 PP=1 step 4: loss +0.42653 grad_norm 3.2088 recompute 0.1s train 0.2s (80000 tok/s)\n"
        "TP=1 PP=1: exported 50 HF tensors\n")
    table = _summary_module().summary(tmp_path)
    for expected in ("NVIDIA H100", "megatron.core yes", "1 failed, 9 passed", "FAILED tests/gpu/test_exactness.py",
                     "bf16 dense numeric part: head fp32, mean_abs 0.0123", "TIMEOUT (110 s)",
                     "qwen2-19m 64 x 128+1024 after rkv 512: 5123.4 tok/s (x hf 1.90)", "compress 3.1 %",
                     "in 16 GiB, rkv B=512+128: 936 sequences (x dense 6.64)", "grad_norm 3.2088",
                     "in 24 GiB, rkv B=512+128 mix: 61000.0 tok/s, 512 rows, 512 sequences of 1366 new (x dense 2.40)",
                     "peak 10.1 GiB allocated / 9.6 GiB admitted",
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
    bench = ("| dense | 35 | 20.112 | 17.500 | 0.010 | 0.500 | 1.800 | 0.100 | 0.020 | 0.182 | 3746 | 40000 | 38.1 | 0 | 0 |\n"
             "| dense | rollout | 9000.0 | 9500.0 | 1.06 |\n"
             "| whole step | 20.112 | 11.000 | 1.83 |\n")
    (tmp_path / "rl_step_bench.log").write_text("# sparse step 1/2: 11.00 s (rollout 8.0, ...)\n" + bench)
    table = _summary_module().summary(tmp_path)
    for expected in ("eval accuracy, dense inference (greedy) 0.266 0.922 +0.656", "Sparse-RL tiny run",
                     "No module named 'datasets'", "dense (35 rows at once): step 20.112 s = rollout 17.500",
                     "MFU 38.1 %", "0 runner builds, 0 captures", "dense rollout: peak 9000.0 MiB, planner 9500.0 MiB (1.06)",
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


def _targets_module():
    import sys

    sys.path.insert(0, str(TOOLS))
    try:
        spec = importlib.util.spec_from_file_location("gpu_targets", TOOLS / "gpu_targets.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses resolve string annotations through the module's entry
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(TOOLS))


H100 = "NVIDIA H100 80GB HBM3 (CUDA 13.0), torch 2.11.0+cu130"


def _batch(batch, new, kv, tps, compress="-", captures="0", machine=H100):
    return {"table": "batch", "model": "qwen2.5-1.5b", "batch": str(batch), "prompt": "128", "new": str(new),
            "engine": "after", "KV": kv, "tok/s": str(tps), "compress %": compress, "captures": captures,
            "machine": machine}


def _memory(workload, kv, tps, rows, captures=0):
    return {"table": "same_memory", "model": "qwen2.5-1.5b", "prompt": 128, "new": 4096, "memory_gib": 24,
            "kv": kv, "workload": workload, "rows": rows, "tok_s": tps, "captures": captures, "machine": H100}


def _rl(mode, step, seconds, rollout, shape="1.5b", prompts=64):
    return {"mode": mode, "step": step, "seconds": {"step": seconds, "rollout": rollout}, "captures": 0,
            "shape": shape, "prompts": prompts, "n_samples": 8, "response_len": 4096 if shape == "1.5b" else 1024,
            "kv_gib": 24 if shape == "1.5b" else 0.5, "device": "NVIDIA H200, wall clock"}


def test_targets_read_met_missed_and_not_measured_from_the_records(tmp_path):
    """Each #43 target from the benchmarks' records: met or missed at its own size on an H100 / H200, not measured
    when a timed call captured graphs (not warm), off the target GPUs, at another size, or with no record; the RL
    step's ratio from two device calls' directories (its modes run apart)."""
    first, second = tmp_path / "a", tmp_path / "b"
    for d in (first, second):
        d.mkdir()
        (d / "steps.tsv").write_text("env\t0\t3\t15\n")
    records = [_batch(64, 128, "dense", 17000.0), _batch(256, 4096, "dense", 25000.0),
               _batch(256, 4096, "rkv B=512", 36000.0, compress="1.5"),
               _memory("fixed", "dense", 20000.0, 204), _memory("fixed", "rkv B=512+128", 45000.0, 512),
               _memory("mix", "dense", 15000.0, 204), _memory("mix", "rkv B=512+128", 33000.0, 512, captures=2),
               {"table": "compaction_scratch", "model": "qwen2.5-1.5b", "batch": 256, "scratch_gib": 0.8,
                "machine": H100}]
    (first / "targets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (first / "rl_step.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        _rl("dense", 0, 260.0, 130.0), _rl("dense", 1, 200.0, 100.0), _rl("dense", 0, 30.0, 10.0, "0.5b", 8),
        _rl("dense", 1, 20.0, 9.0, "0.5b", 8)]))
    (second / "rl_step.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        _rl("sparse", 0, 150.0, 60.0), _rl("sparse", 1, 130.0, 45.0)]))
    targets = _targets_module()
    lines = dict(line.split("  ", 1) for line in targets.target_lines([first, second]))
    status = {text.strip(): "not measured" if rest.strip().startswith("not measured") else rest.split()[0]
              for text, rest in lines.items()}
    assert status == {
        "Dense: batch 64 +128 >= 16,000 tok/s": "met", "Dense: batch 256 +4,096 >= 30,000 tok/s": "missed",
        "Compaction <= 2 % of the R-KV call (batch 256 +4,096)": "met",
        "Compaction scratch <= 1 GiB at batch 256": "met",
        "24 GiB, +4,096: R-KV 512+128 >= 2.5x dense, fixed-length wave": "missed",
        "24 GiB, +4,096: R-KV 512+128 >= 2x dense, length mix": "not measured",
        "Batch 256 +4,096: R-KV 512+128 >= 1.3x dense": "met",
        "RL step (1.5B, 64 x 8, +4,096, same memory): R-KV >= 1.4x dense": "met",
        "RL step's rollout phase: R-KV >= 2x dense": "met"}, lines
    text = "\n".join(targets.target_lines([first, second]))
    assert "2.25x (45,000 / 20,000 tok/s, 512 / 204 rows)" in text and "captured 2 graphs: not warm" in text
    assert "1.54x (200.0 / 130.0 s)" in text and "2.22x (100.0 / 45.0 s)" in text
    # one directory alone: the RL step's sparse mode is missing; the reduced size is shown, not judged
    alone = "\n".join(targets.target_lines([first]))
    assert re.search(r"R-KV >= 1.4x dense\s+not measured\s+not at the target's size", alone)
    # off the target GPUs: never met, whatever the figure
    (first / "targets.jsonl").write_text(json.dumps(_batch(64, 128, "dense", 99999.0, machine="AMD EPYC, torch")))
    assert re.search(r">= 16,000 tok/s\s+not measured\s+99,999 tok/s \(on AMD EPYC, torch: not an H100 / H200\)",
                     "\n".join(targets.target_lines([first])))
    table = _summary_module().summary(first, second)
    assert "#43's targets" in table and table.count("summary of") == 2


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash, timeout")
def test_a_dry_run_of_the_targets_profile_on_cpu(tmp_path):
    """The targets profile's commands as written, on the CPU at tiny shapes: every flag parses, each benchmark writes
    its records, and the summary reads them (nothing is measured: a CPU and tiny shapes). Slow: two benchmark
    processes, ~30 s of CPU."""
    import os
    import sys

    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECKS_DRY_RUN": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(["bash", str(SCRIPT), str(out), "targets"], env=env, check=True, capture_output=True, timeout=600)
    steps = {line.split("\t")[0]: line.split("\t")[1] for line in (out / "steps.tsv").read_text().splitlines()}
    assert steps["rollout_batch"] == "0" and steps["rollout_memory"] == "0", steps
    records = [json.loads(line) for line in (out / "targets.jsonl").read_text().splitlines()]
    assert {r["table"] for r in records} == {"batch", "same_memory_fit", "same_memory"}
    assert {(r["workload"], r["kv"]) for r in records if r["table"] == "same_memory"} == {
        (w, kv) for w in ("mix", "fixed") for kv in ("dense", "rkv B=16+8")}
    summary = (out / "summary.txt").read_text()
    targets = _targets_module()
    for target in targets.TARGETS:
        assert re.search(re.escape(target.text) + r"\s+not measured", summary), target.text
    assert (out / "logs.tar.gz").is_file() and not list(out.glob("*.log"))
