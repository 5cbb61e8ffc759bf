"""The planner's Megatron layouts (#45): every layout is checked against the model's heads, KV heads and layers,
--gpus N lists the layouts of N GPUs best first, --help shows the defaults, and a plan that fits nowhere says why."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from slime_sparse.planner.known_models import known_config
from slime_sparse.planner.learner_layouts import layout_problems, layouts_of, plan_layout, rank_layouts
from slime_sparse.planner.memory import GIB, plan_learner
from slime_sparse.utils.model_shape import ModelShape

TOOL = Path(__file__).resolve().parents[2] / "tools" / "plan_memory.py"
QWEN7B = ModelShape.from_hf_config(known_config("Qwen2.5-7B"))  # 28 heads, 4 KV heads, 28 layers


def tool():
    spec = importlib.util.spec_from_file_location("plan_memory", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tp,pp,ok", [(1, 1, True), (2, 1, True), (4, 1, True), (4, 7, True), (1, 28, True),
                                      (3, 1, False), (8, 1, False), (16, 1, False), (1, 3, False), (2, 8, False)])
def test_a_layout_must_split_heads_kv_heads_and_layers_evenly(tp, pp, ok):
    problems = layout_problems(QWEN7B, tp, pp)
    expected = (28 % tp == 0 and 4 % tp == 0 and 28 % pp == 0)
    assert (not problems) == expected == ok
    if tp == 8:
        assert problems == ["TP 8 does not divide the 28 attention heads", "TP 8 does not divide the 4 KV heads"]
    if (tp, pp) == (1, 3):
        assert problems == ["PP 3 does not divide the 28 layers"]


def test_layouts_of_n_gpus_are_every_factorisation():
    assert sorted(layouts_of(8)) == sorted((tp, pp, 8 // (tp * pp)) for tp in range(1, 9) for pp in range(1, 9)
                                           if 8 % (tp * pp) == 0)
    assert len(layouts_of(8)) == 10 and layouts_of(1) == [(1, 1, 1)]
    with pytest.raises(ValueError, match="--gpus=0"):
        layouts_of(0)


def test_ranking_fits_first_least_recompute_then_fewest_model_parallel_ranks():
    acts = {None: 200 * GIB, "selective": 80 * GIB, "full": 20 * GIB}
    plans = [plan_layout(QWEN7B, *layout, acts, with_ref=True) for layout in layouts_of(8)]
    ranked = rank_layouts(plans, 80 * GIB)
    valid = [p for p in ranked if not p.problems]
    assert [p.name for p in ranked if p.problems] and all(p.problems for p in ranked[len(valid):])
    order = {"none": 0, "selective": 1, "full": 2, None: 3}
    keys = [(order[p.fits_with(80 * GIB)], p.tp * p.pp, p.pp) for p in valid]
    assert keys == sorted(keys)
    for p in valid:  # the memory is the planner's own arithmetic, divided over the model-parallel ranks
        state = plan_learner(QWEN7B, tp=p.tp, pp=p.pp, dp=p.dp, with_ref=True).bytes_per_gpu
        assert p.total_bytes == tuple(state + a // (p.tp * p.pp) for a in acts.values())


def test_cli_gpus_lists_the_layouts_best_first_and_the_impossible_ones_with_why(capsys):
    assert tool().main(["--hf-config", "Qwen2.5-7B", "--prompt-len", "512", "--max-new-tokens", "8192",
                        "--gpus", "8", "--use-kl-loss"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("TP x PP x DP"):].splitlines()[1:]
    rows = [line.split() for line in table if line[:1].isdigit()]
    assert rows and rows[0][-1] == "none" and rows[-1][0] == "1x1x8" and rows[-1][-1] == "-"
    assert {r[0] for r in rows} == {"4x1x2", "2x2x2", "1x4x2", "4x2x1", "2x4x1", "2x1x4", "1x2x4", "1x1x8"}
    assert "8x1x1 is no layout of this model: TP 8 does not divide the 28 attention heads" in out
    assert "1x8x1 is no layout of this model: PP 8 does not divide the 28 layers" in out
    assert "1x1x8 does not fit, even with full recompute: 67.4 GiB of state" in out


def test_cli_explicit_layouts_are_checked_too(capsys):
    assert tool().main(["--hf-config", "Qwen2.5-7B", "--prompt-len", "512", "--learner-layouts", "3x1x1",
                        "2x1x4"]) == 0
    out = capsys.readouterr().out
    assert "3x1x1 is no layout of this model: TP 3 does not divide the 28 attention heads" in out
    assert not any(line.startswith("3x1x1") for line in out.splitlines())
    assert any(line.startswith("2x1x4") for line in out.splitlines())


def test_a_plan_that_fits_nowhere_says_why_in_words(capsys):
    assert tool().main(["--hf-config", "Qwen2.5-72B", "--prompt-len", "512", "--max-new-tokens", "8192",
                        "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("largest micro-batch (learner)"))
    assert row.split()[3:7] == ["none", "fits", "none", "fits"]
    assert "none fits (dense/none, dense/full, rkv/none, rkv/full): the learner needs" in out
    assert "no layout of 1 GPU fits 80 GiB" in out
    assert "the weights, gradients and optimizer state alone take" in out


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        tool().main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--gpu-gib", "80.0"), ("--dtype", "bfloat16"), ("--max-new-tokens", "1024"),
                          ("--kv-budget", "512"), ("--kv-buffer", "128"), ("--rollout-batch-size", "128"),
                          ("--max-tokens-per-gpu", "16384"), ("--mem-fraction-static", "0.7")):
        assert f"(default: {default})" in text.split(flag, 2)[-1].split(" --", 1)[0] or \
            f"(default: {default})" in text, flag
    assert "--gpus" in text
