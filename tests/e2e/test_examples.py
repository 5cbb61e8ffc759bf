"""The recipes: the GPU ones that cannot run here still parse and fit the layout rules the Ray groups enforce at
start-up; the tiny CPU one (the README's main job and its study) runs a short version end to end."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest

from slime_sparse.config_loader import load_config
from slime_sparse.factory import EngineSpec
from slime_sparse.ray.layout import ClusterLayout

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


@pytest.fixture()
def qwen25_7b(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(EXAMPLES, "multinode"))
    import qwen25_7b

    return qwen25_7b


def test_qwen25_7b_recipe_parses_and_fits_its_layout(qwen25_7b, tmp_path, capsys):
    ray_learner = pytest.importorskip("slime_sparse.ray.learner_group")  # needs ray
    from slime_sparse.rollout.sglang.worker import check_ray_layout

    model = tmp_path / "Qwen2.5-7B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1?", "label": "2"}\n')
    flags = qwen25_7b.train_flags(str(model), str(data), str(data), str(tmp_path / "run"))
    cfg = load_config(["--use-ray", *flags])  # every flag known, every value valid

    layout = ClusterLayout.from_config(cfg.cluster, use_gpu=True)
    assert (layout.learner_ranks, layout.num_engines, layout.bundles_per_engine) == (8, 8, 1)
    ray_learner.check_megatron_layout(cfg.megatron, layout.learner_ranks)
    check_ray_layout(EngineSpec.from_run(cfg), num_engines=layout.num_engines, servers_per_engine=layout.bundles_per_engine,
                     colocate=layout.colocate, use_gpu=True)
    dp = layout.learner_ranks // cfg.megatron.tensor_model_parallel_size
    samples = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    assert dp == 4 and samples // cfg.train.global_batch_size == 4 and cfg.train.global_batch_size % dp == 0
    # the authors' settings (docs/algorithm.md)
    assert (cfg.kv.method, cfg.kv.budget, cfg.kv.buffer, cfg.kv.window) == ("rkv", 512, 128, 8)
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.adam_beta2) == (1e-6, 0.1, 0.98)
    assert cfg.correction.preset == "mis" and cfg.loss.kl_loss_coef == 1e-4 and cfg.train.bf16

    assert qwen25_7b.main(["--head", "10.0.0.1", "--model", str(model), "--data", str(data), "--eval-data",
                           str(data), "--run-dir", "runs/x", "--dry-run", "--num-rollout", "3"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[2:4] == ["submit", "10.0.0.1"] and printed[-2:] == ["--num-rollout", "3"]


def _real_model_run():
    """examples/real_model/run.py, loaded under its own name: other recipes have a run.py too."""
    spec = importlib.util.spec_from_file_location("real_model_run", os.path.join(EXAMPLES, "real_model", "run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_real_model_recipe_parses_and_grades(monkeypatch, tmp_path):
    """examples/real_model: every flag known and valid, the grader importable by name as the workers import it,
    and the grader's reading of answers (the real-model tests grade live outputs with it)."""
    monkeypatch.syspath_prepend(os.path.join(EXAMPLES, "real_model"))
    import products

    real_run = _real_model_run()

    model = tmp_path / "model"
    model.mkdir()
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.jsonl", "eval.jsonl"):
        (data / name).write_text(json.dumps({"prompt": [{"role": "user", "content": "2 * 3?"}], "label": "6"}) + "\n")
    for short in (False, True):
        cmd = real_run.train_command(str(model), str(data), str(tmp_path / "run"), short, ["--lr", "2e-5"])
        assert cmd[0] == "slime-sparse-train"
        cfg = load_config(cmd[1:])
        assert cfg.kv.method == "rkv" and cfg.kv.budget + cfg.kv.buffer < cfg.sampling.max_new_tokens
        assert cfg.data.apply_chat_template and cfg.correction.preset == "mis" and cfg.train.lr == 2e-5
        assert cfg.reward.resolve_grader() is products.reward
    # answer line first, else the last integer; markdown and trailing dots tolerated
    assert products.extract_answer("5 * 9 = 45\nAnswer: 45.") == "45"
    assert products.extract_answer("**Answer:** 54") == "54"
    assert products.extract_answer("7 * 8 = 56, so the product is 56") == "56"
    assert products.extract_answer("I cannot help with that.") is None


def test_real_model_summary_table(tmp_path):
    """The recipe's before/after table: evaluations at the first and last step, rollout metrics averaged
    over the first and last quarter of the run."""
    real_run = _real_model_run()
    records = [{"step": s, f"eval_{m}/pass@1": acc, f"eval_{m}/n_prompts": 25.0}
               for s, accs in ((0, (0.4, 0.44)), (8, (0.6, 0.52))) for m, acc in zip(("dense", "sparse"), accs)]
    records += [{"step": s, "rollout/reward_mean": s / 10, "kv/savings": 0.5} for s in range(1, 9)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = {label: (before, after) for label, before, after in real_run.summary_rows(str(tmp_path))}
    assert rows["eval accuracy, dense (greedy, 25 problems)"] == (0.4, 0.6)
    assert rows["eval accuracy, R-KV B=32 (greedy, 25 problems)"] == (0.44, 0.52)
    assert rows["rollout reward (T=0.7, R-KV)"] == pytest.approx((0.15, 0.75))  # steps 1-2 and 7-8
    assert rows["KV token savings"] == (0.5, 0.5)
    assert "| eval accuracy, dense (greedy, 25 problems) | 0.4000 | 0.6000 |" in real_run.summary_table(str(tmp_path))


# ---------------------------------------------------------------- the tiny CPU recipe (the README's main job)

MICRO_FLAGS = ["--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
               "--global-batch-size", "4", "--rollout-max-response-len", "32", "--kv-budget", "12", "--kv-buffer", "4",
               "--kv-window", "4", "--eval-max-prompts", "4", "--eval-interval", "1", "--save-interval", "1",
               "--no-progress-bar", "--no-use-tensorboard"]


@pytest.fixture()
def tiny_recipe(monkeypatch):
    """examples/tiny_cpu's run and compare modules, with micro assets (a few warm-start steps) in place of the
    recipe's: the real recipe's flags and variants, a short run."""
    from slime_sparse.tasks.assets import AssetsConfig
    from slime_sparse.tasks.repeated_add import RepeatedAddConfig
    from slime_sparse.tasks.tiny_model import TinyModelConfig
    from slime_sparse.tasks.warm_start import WarmStartConfig

    monkeypatch.syspath_prepend(os.path.join(EXAMPLES, "tiny_cpu"))
    import compare
    import run

    micro = AssetsConfig(task=RepeatedAddConfig(min_count=2, max_count=3),
                         model=TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                               intermediate_size=64, max_position_embeddings=128),
                         warm_start=WarmStartConfig(steps=3, batch_size=4), direct_answer_frac=0.5, n_train=64, n_test=8)
    monkeypatch.setattr(run, "ASSETS", micro)
    return run, compare


def test_tiny_recipe_short_study_runs_and_its_metrics_are_finite(tiny_recipe, tmp_path, capsys, monkeypatch):
    run, compare = tiny_recipe
    cache = str(tmp_path / "assets")

    def in_process(variant, seed, run_dir, cache_dir, extra, threads):  # compare's child processes, in this one
        return run.main(["--variant", variant, "--cache-dir", cache_dir, "--run-dir", run_dir, "--", *extra,
                         "--seed", str(seed)], assets_config=run.ASSETS)

    monkeypatch.setattr(compare, "run_one", in_process)
    out = tmp_path / "study"
    assert compare.main(["--variants", "dense", "sparse_rl", "--seeds", "1", "--out", str(out), "--cache-dir", cache,
                         "--", *MICRO_FLAGS]) == 0
    printed = capsys.readouterr().out
    assert "KV token savings" in printed and "dense GRPO learns" in printed and "nan" not in printed
    assert (out / "study.png").stat().st_size > 10_000

    for variant in ("dense", "sparse_rl"):
        rows, _ = run.summarize(str(out / f"{variant}-seed1"))
        values = {label: (start, end) for label, start, end, _ in rows}
        for label, (start, end) in values.items():
            assert math.isfinite(start) and math.isfinite(end), (variant, label)
        # both variants are evaluated under dense and sparse inference (dense: --eval-kv-method rkv)
        assert {"eval accuracy, dense inference (greedy)", "eval accuracy, sparse inference (greedy)"} <= set(values)
        savings = values["KV token savings"][1]
        assert savings == 0.0 if variant == "dense" else savings > 0.0
    table = run.summary_table(str(out / "sparse_rl-seed1"))
    assert table.splitlines()[0].split() == ["metric", "start", "end", "change"]


def test_every_tiny_recipe_variant_is_a_valid_config(tiny_recipe, tmp_path):
    """A variant is the recipe's flags plus its row: each row must build a config that says what the row asks."""
    run, compare = tiny_recipe
    from slime_sparse.config_loader import load_config

    assert set(run.PAPER_VARIANTS) <= set(run.VARIANTS)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    for name, extra in run.VARIANTS.items():
        cfg = load_config(["--hf-checkpoint", str(tmp_path), "--prompt-data", str(data), *run.RECIPE, *extra])
        assert cfg.kv.method == extra[extra.index("--kv-method") + 1], name
        if "--loss-type" in extra:
            assert cfg.loss.loss_type == extra[extra.index("--loss-type") + 1], name
        if "--dynamic-sampling-filter-path" in extra:
            assert cfg.rollout.dynamic_sampling_filter_path, name


def test_every_ablation_is_a_valid_config_that_says_what_its_row_asks(tiny_recipe, tmp_path):
    """examples/tiny_cpu/ablations.py: each variant's flags build the config its name describes."""
    run, compare = tiny_recipe
    import ablations

    from slime_sparse.config_loader import load_config

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    seen = {}
    for group, variants in ablations.ABLATIONS.items():
        for name, (base, flags) in variants.items():
            cfg = load_config(["--hf-checkpoint", str(tmp_path), "--prompt-data", str(data), *run.RECIPE,
                               *run.VARIANTS[base], *ablations.COMMON, *flags])
            seen[name] = cfg
            if group == "control":
                assert cfg.kv.method == "none" and cfg.correction.preset == "mis"
            if group == "veto":
                assert cfg.correction.seq_veto == float(name.split()[1]) and cfg.correction.token_mask_low == 0.5
            if "budget" in name or "B=" in name:
                budget = int(name.split("budget ")[1].split()[0]) if "budget" in name else int(name.split("B=")[1])
                assert cfg.kv.budget == budget and cfg.kv.method == "rkv"
    assert seen["sequence (decoupled_seq_is_rs), B=12"].correction.rs == ("seq_sum_k1",)
    assert seen["geometric (decoupled_geo_rs), B=12"].correction.rs == ("seq_mean_k1",)
    assert seen["none, B=12"].correction.preset == "none"
    assert ablations.QUARTER * 4 == ablations.HALF * 2 == ablations.WHOLE == ablations.MEAN_RESPONSE_LEN


def test_ablation_table_reads_finished_runs(tiny_recipe, tmp_path, capsys, monkeypatch):
    run, compare = tiny_recipe
    import ablations

    cache = str(tmp_path / "assets")

    def in_process(variant, seed, run_dir, cache_dir, extra, threads):
        return run.main(["--variant", variant, "--cache-dir", cache_dir, "--run-dir", run_dir, "--", *extra,
                         "--seed", str(seed)], assets_config=run.ASSETS)

    monkeypatch.setattr(compare, "run_one", in_process)
    monkeypatch.setattr(ablations, "COMMON", [])
    monkeypatch.setitem(ablations.ABLATIONS, "veto", {"veto 1e-3": ("sparse_rl", ["--correction-seq-veto", "1e-3"])})
    out, plot = tmp_path / "abl", tmp_path / "abl.png"
    assert ablations.main(["--groups", "control", "veto", "--seeds", "1", "--out", str(out), "--plot", str(plot),
                           "--cache-dir", cache, "--", *MICRO_FLAGS]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| control") or
             line.startswith("| veto")]
    assert len(lines) == 2 and "nan" not in "".join(lines)
    control = dict(zip(["group", "variant", "seeds", *(c[0] for c in ablations.COLUMNS)],
                       [c.strip() for c in lines[0].strip("|").split("|")]))
    assert control["seeds"] == "1" and control["seq. rejected"] == "0.000"  # the dense control: nothing, in fp32
    assert plot.stat().st_size > 10_000
