"""The benchmark scripts run end to end in their CI-sized mode (nothing is timed here: only what the tables
report besides time is checked)."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


@pytest.mark.skipif(shutil.which("git") is None, reason="--before extracts a commit with git")
def test_rollout_bench_ci_rows():
    bench = load("rollout_bench")
    lines = bench.main(["--suite", "ci", "--before", "HEAD", "--repeats", "1"])
    rows = [dict(zip(cells(bench.HEADER.splitlines()[0]), cells(line))) for line in lines]
    # 2 rows x (hf + before/after x {dense, rkv B=16})
    assert [(r["batch"], r["engine"], r["KV"]) for r in rows] == [
        (b, e, kv) for b in ("4", "2x2") for e, kv in
        [("hf", "dense"), ("before", "dense"), ("after", "dense"), ("before", "rkv B=16"), ("after", "rkv B=16")]]
    for r in rows:
        assert float(r["tok/s"]) > 0 and 0 < float(r["roofline %"])
        if r["engine"] == "after":  # HEAD against itself, same seed: the same tokens, prefill shared or not
            assert r["= before"] == "yes"
        if r["engine"] != "hf":
            assert float(r["x hf"]) > 0
        assert r["captures"] == ("-" if r["engine"] == "hf" else "0")  # warmed at the row's length (no graphs on CPU)
    dense = {(r["batch"], r["engine"]): float(r["peak KV MiB"]) for r in rows if r["KV"] == "dense"}
    for r in rows:
        if r["KV"] != "dense":
            assert float(r["peak KV MiB"]) < dense[(r["batch"], r["engine"])]
            assert 0 <= float(r["compress %"]) < 100
    saved = {(r["batch"], r["engine"]): r["prefill saved"] for r in rows}
    # only this checkout's engine shares prefill, and only across the 2 samples of a prompt: 2 prompts x 24 tokens
    # (HEAD is this checkout here, so before shares too)
    assert saved[("4", "after")] == "0" and saved[("2x2", "after")] == "48" and saved[("2x2", "before")] == "48"


def test_rollout_bench_rejects_bad_rows():
    bench = load("rollout_bench")
    with pytest.raises(SystemExit, match="MODEL:BATCH:PROMPT:NEW"):
        bench.parse_args(["--rows", "tiny:4:x:40"])
    with pytest.raises(SystemExit, match="N must divide BATCH"):
        bench.parse_args(["--rows", "tiny:4:24:40:3"])


def test_learner_bench_ci_row():
    bench = load("learner_bench")
    corr, ref = bench.main(["--suite", "ci", "--repeats", "1"])
    assert len(corr) == 1 and len(ref) == 1
    row = dict(zip(cells(bench.CORRECTION_HEADER.splitlines()[0]), cells(corr[0])))
    assert (row["model"], row["batch"], row["correction"]) == ("tiny", "8", "mis")
    # responses are drawn in [R/2, R] = [12, 24]
    assert 12 <= float(row["mean response"]) <= 24
    for key in ("plain GRPO s/step", "Sparse-RL s/step", "correction + metrics ms"):
        assert float(row[key]) > 0
    ref_row = cells(ref[0])
    assert ref_row[:3] == ["tiny", "8", "16"] and float(ref_row[3]) > 0 and float(ref_row[4]) > 0


def test_learner_bench_makes_samples_the_correction_acts_on():
    """The synthetic rollout exercises the correction: some tokens rejected, weights not all 1."""
    bench = load("learner_bench")
    from slime_sparse.rollout import pipeline
    from slime_sparse.algo import CorrectionConfig, LossConfig

    row = bench.RowSpec.parse("tiny:8:16:24")
    model = bench.build_model("tiny", 41, seed=0)
    learner = bench.learner_for(model, bench.parse_args(["--suite", "ci"]), LossConfig())
    prepared = pipeline.prepare_rollout(bench.make_samples(row, 512, 0), learner, CorrectionConfig.from_preset("mis"))
    masks = torch.cat(prepared.batch.loss_masks)
    weights = torch.cat(prepared.batch.weights)
    assert 0 < masks.sum() < masks.numel() and weights.std() > 0


def test_mismatch_split_cost_ci_row(capsys):
    bench = load("mismatch_split_cost")
    assert bench.main(["--suite", "ci", "--repeats", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    row = dict(zip(cells(lines[0]), cells(lines[2])))
    assert (row["model"], row["batch"], row["budget"]) == ("tiny", "8", "12")
    assert float(row["compressed"]) == 1.0  # every sample was compressed: the split needs its shadow forward
    for key in ("generate s", "prepare s", "train s", "split s"):
        assert float(row[key]) > 0
    assert float(row["split / rest"].rstrip(" %")) > 0
    with pytest.raises(SystemExit, match="MODEL:BATCH:PROMPT:RESPONSE:BUDGET"):
        bench.parse_args(["--rows", "tiny:8:8:x:12"])


def test_rl_step_bench_tiny_runs_the_loop_and_its_phases_make_the_step(tmp_path):
    """2 GRPO steps of the training loop per mode on the tiny shape: every phase prints, the timed phases and the loop's
    bookkeeping add up to the whole step, the modes got the same KV memory (the dense
    engine decodes fewer sequences at once), and the planner's estimate prints beside each planned phase."""
    bench = load("rl_step_bench")
    out = tmp_path / "steps.jsonl"
    tables = bench.main(["--shape", "tiny", "--device", "cpu", "--steps", "2", "--cache-dir", str(tmp_path / "model"),
                         "--out", str(out)])
    header = cells(bench.TIME_HEADER.splitlines()[0])
    rows = {r["mode"]: r for r in (dict(zip(header, cells(line))) for line in tables["time"])}
    assert set(rows) == {"dense", "sparse"}
    phases = [f"{p} s" for p in (*bench.PHASES, "other")]
    for mode, r in rows.items():
        assert all(float(r[p]) >= 0 for p in phases)
        assert min(float(r["rollout s"]), float(r["recompute s"]), float(r["learner step s"])) > 0
    # the same memory, as the trainer's --rollout-kv-cache-gib alone: each mode's rows are its engine's admission
    # (8 rows of R-KV 16 + 8 slots, a query ring and their working sets hold 2 dense rows of 16 + 64 slots today)
    from transformers import AutoModelForCausalLM

    from slime_sparse.rollout.embedded import EmbeddedEngine

    tiny = AutoModelForCausalLM.from_pretrained(next((tmp_path / "model").iterdir()))
    args, admitted = bench.parse_args(["--shape", "tiny"]), {}
    for mode in ("dense", "sparse"):
        kv = bench.kv_config(args, mode)
        admitted[mode] = min(8, EmbeddedEngine(tiny, kv, kv_cache_gib=args.kv_gib).rows_for(kv, 16 + 64))
    assert {mode: int(r["rows at once"]) for mode, r in rows.items()} == admitted
    assert admitted["sparse"] >= 3 * admitted["dense"] >= 3
    # the engine stays warm across steps: one runner, built by the first step; nothing built or captured after it
    assert all(r["runner builds"] == "0" and r["captures"] == "0" for r in rows.values())
    memory = [dict(zip(cells(bench.MEMORY_HEADER.splitlines()[0]), cells(line))) for line in tables["memory"]]
    assert [(m["mode"], m["phase"]) for m in memory] == [(mode, p) for mode in ("dense", "sparse")
                                                          for p in bench.PLANNED]
    assert all(float(m["planner MiB"]) > 0 and m["measured peak MiB"] == "-" for m in memory)  # no CUDA here
    assert [cells(line)[0] for line in tables["ratio"]] == ["whole step", "rollout phase"]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r["step"]) for r in records] == [("dense", 0), ("dense", 1), ("sparse", 0), ("sparse", 1)]
    assert all(r["gen_tokens"] == 8 * 64 for r in records)  # every answer ran to the response length
    assert [r["runner_builds"] for r in records] == [1, 0, 1, 0] and all(r["captures"] == 0 for r in records)
    for r in records:  # each step, warm-up included: the phases and the rest ("other", bookkeeping) make the step;
        # how small "other" is is the benchmark's table to show, not a unit test's (a time, noisy under load)
        seconds = r["seconds"]
        assert sum(seconds[p] for p in (*bench.PHASES, "other")) == pytest.approx(seconds["step"], rel=1e-9)
        assert seconds["other"] >= 0, r


def test_sglang_compaction_cost_ci_rows(capsys):
    """The cost model's table: the loop's ops and syncs grow with the due requests, the batched call's do not (one
    call here), and it never syncs; --check finds the loop and the batched call leave the same cache."""
    bench = load("sglang_compaction_cost")
    assert bench.main(["--methods", "snapkv", "--due", "1", "4", "--layers", "3", "--check"]) == 0
    out = capsys.readouterr().out
    header, _, *rows = [line for line in out.splitlines() if line.startswith("|")]
    table = [dict(zip(cells(header), cells(line))) for line in rows]
    assert [r["due requests"] for r in table] == ["1", "4"]
    one, four = table
    assert int(four["loop ops"]) > 3 * int(one["loop ops"]) and four["batched ops"] == one["batched ops"]
    assert int(four["loop syncs"]) == 4 and four["batched syncs"] == one["batched syncs"] == "0"
    assert out.count("loop == batched: True") == 2


def test_rollout_bench_same_memory_and_op_counts(tmp_path):
    """--same-memory-gib: each config admits what fits in that memory by the engine's own admission, compression fitting
    more sequences, and runs a fixed wave of its fit and a length mix of the same sequences for all, each warm (no
    capture in a timed call); the mix's lengths come from the samples' streams alone, so every config generates the
    same tokens. --count-ops: a compaction is one batched call whose operations do not grow with the rows compressing,
    and neither the decode step nor a compaction synchronises with the host."""
    import json

    bench = load("rollout_bench")
    out = tmp_path / "rows.jsonl"
    lines = bench.main(["--rows", "tiny:4:24:40", "tiny:16:24:40", "--budgets", "16", "--buffer", "8", "--methods",
                        "rkv", "h2o", "--same-memory-gib", "0.0006", "--same-memory-only", "--count-ops", "--repeats",
                        "1", "--mix-prompts", "24", "--json", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    fits = [r for r in records if r["table"] == "same_memory_fit"]
    runs = [r for r in records if r["table"] == "same_memory"]
    assert [r["kv"] for r in fits] == ["dense", "rkv B=16+8", "h2o B=16+8"]  # one row: the batch is what fits
    fit = {r["kv"]: r["fit"] for r in fits}
    # a row of this tiny model: its 64 dense slots weigh little beside the step's per-row logits and sampler, so
    # compression fits only a third more here (long rows of a real model: tools/plan_memory.py --rollout-kv-cache-gib)
    assert fit["rkv B=16+8"] > fit["dense"] > 0
    assert all(r["machine"].endswith(f"torch {torch.__version__}") for r in records)
    assert [(r["kv"], r["workload"]) for r in runs] == [(kv, w) for kv in fit for w in ("mix", "fixed")]
    for r in runs:
        assert r["captures"] == 0 and r["tok_s"] > 0 and r["same_tokens"]
        if r["workload"] == "fixed":  # one wave of what fits, every sequence to the end
            assert r["rows"] == r["sequences"] == fit[r["kv"]] and r["mean_new"] == 40
        else:  # the same 24 sequences for every config, ending at sampled lengths (mean 40 // 3, capped at 40)
            assert r["sequences"] == 24 and r["rows"] == min(24, fit[r["kv"]]) and 3 < r["mean_new"] < 30
        assert (r["compress_pct"] is None) == (r["kv"] == "dense")
    assert len({r["mean_new"] for r in runs if r["workload"] == "mix"}) == 1  # the same tokens, so the same lengths
    assert all(r["x_dense"] == 1.0 for r in runs if r["kv"] == "dense")
    ops = [dict(zip(cells(bench.OPS_HEADER.splitlines()[0]), cells(line))) for line in lines if len(cells(line)) == 10]
    compact = {(r["batch"], r["KV"]): int(r["ops / compaction"]) for r in ops if r["KV"] != "dense"}
    assert compact[("4", "h2o B=16")] == compact[("16", "h2o B=16")] > 0  # one call, whatever the rows
    assert compact[("4", "rkv B=16")] == compact[("16", "rkv B=16")] > 0
    assert all(r["syncs / decode step"] == "0" and r["syncs / compaction"] == "0" for r in ops)
