"""The long-horizon study's tooling (examples/tiny_cpu/long_horizon*.py): the table, the collapse events and the
plot from a fixture of metrics, and one micro cell run end to end, resumed and reported."""
from __future__ import annotations

import json
import math
import os

import pytest

from slime_sparse.config_loader import load_config

TINY_CPU = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "tiny_cpu")


@pytest.fixture()
def study(monkeypatch):
    monkeypatch.syspath_prepend(TINY_CPU)
    import long_horizon
    import long_horizon_report

    return long_horizon, long_horizon_report


def _write_run(path, rewards, *, ppl=None, grad=None, evals=None, n_prompts=100, k3=0.1):
    """A metrics.jsonl as the trainer writes it: rollout records, then eval records at some steps."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w", encoding="utf-8") as fh:
        for mode, acc in (evals or {}).get(0, {}).items():
            fh.write(json.dumps({"step": 0, f"eval_{mode}/pass@1": acc, f"eval_{mode}/n_prompts": n_prompts}) + "\n")
        for i, r in enumerate(rewards):
            step = i + 1
            rec = {"step": step, "time": 0.0, "rollout/reward_mean": r, "rollout/response_len_mean": 300.0,
                   "mismatch/k3": k3 * step, "mismatch/sampler_ppl": (ppl or [1.5] * len(rewards))[i],
                   "train/grad_norm": (grad or [1.0] * len(rewards))[i]}
            fh.write(json.dumps(rec) + "\n")
            for mode, acc in (evals or {}).get(step, {}).items():
                fh.write(json.dumps({"step": step, f"eval_{mode}/pass@1": acc, f"eval_{mode}/n_prompts": n_prompts})
                         + "\n")
    with open(os.path.join(path, "cell_time.jsonl"), "w", encoding="utf-8") as fh:
        fh.write(json.dumps({"from_rollout": 0, "to_rollout": len(rewards), "rc": 0, "wall_s": 7200.0,
                             "cpu_s": 3600.0}) + "\n")


def test_wilson_interval_by_hand(study):
    _, rep = study
    lo, hi = rep.wilson(50, 100)
    # (p + z^2/2n) / (1 + z^2/n) -+ z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n), p = 0.5, n = 100, z = 1.96
    assert (lo, hi) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    assert rep.wilson(0, 10)[0] == 0.0 and rep.wilson(10, 10)[1] == 1.0
    assert all(math.isnan(x) for x in rep.wilson(0, 0))


def test_table_pools_seeds_and_reads_windows(study, tmp_path):
    _, rep = study
    evals_a = {0: {"dense": 0.2, "sparse": 0.1}, 20: {"dense": 0.6, "sparse": 0.3}}
    evals_b = {0: {"dense": 0.2, "sparse": 0.1}, 20: {"dense": 0.8, "sparse": 0.5}}
    _write_run(tmp_path / "a", [0.1] * 10 + [0.5] * 10, evals=evals_a)
    _write_run(tmp_path / "b", [0.3] * 10 + [0.7] * 12, evals=evals_b)  # ran 2 rollouts further
    runs = {("quarter", "naive_sparse"): [rep.load_run(str(tmp_path / d)) for d in "ab"]}
    assert rep.common_rollouts(runs[("quarter", "naive_sparse")]) == 20
    assert rep.window_mean(runs[("quarter", "naive_sparse")], "rollout/reward_mean", end=False) == pytest.approx(0.2)
    assert rep.window_mean(runs[("quarter", "naive_sparse")], "rollout/reward_mean", end=True) == pytest.approx(0.6)
    mean, lo, hi, seeds = rep.pooled(runs[("quarter", "naive_sparse")], "dense", 20)
    assert mean == pytest.approx(0.7) and seeds == [0.6, 0.8]
    assert (lo, hi) == pytest.approx(rep.wilson(140, 200))
    table = rep.study_table(runs, {"quarter": 89})
    row = table.splitlines()[2]
    assert row.startswith("| quarter (B=89) | naive_sparse | 2 | 20 | 0.200 → 0.700 [")
    assert "(seeds 0.60-0.80)" in row and "| 0.200 → 0.600 |" in row and "| 300 → 300 |" in row
    assert "| 0.100 → 0.400 [" in row  # sparse accuracy: (0.3 + 0.5) / 2 at the end
    assert "| 0.550 → 1.550 | - | - | - |" in row  # k3 = 0.1 x step: rollouts 1-10, 11-20; absent columns
    times = rep.time_table(runs)
    assert "| quarter | naive_sparse | 42 | 2.00 | 4.00 |" in times and times.endswith("| all | | | 2.00 | 4.00 |")


def test_collapse_events(study, tmp_path):
    _, rep = study
    rewards = [0.2, 0.4, 0.6, 0.8, 0.8, 0.8, 0.8, 0.8] + [0.05] * 12
    ppl = [math.exp(1.0)] * 10 + [math.exp(0.01)] * 10  # entropy 1 nat, then 0.01
    grad = [1.0] * 15 + [9.0] + [1.0] * 4
    _write_run(tmp_path / "c", rewards, ppl=ppl, grad=grad)
    ev = rep.collapse_events(rep.load_run(str(tmp_path / "c")))
    # trailing mean of 5: at rollout 11 it is (0.8 + 4 x 0.05) / 5 = 0.2 < 0.5 x 0.8; at 10 (2 x 0.8 + ...) = 0.35
    assert ev["reward_halved"] == 11
    # trailing mean of the entropy: at rollout 15 it is 0.01, at 14 (1 + 4 x 0.01) / 5 = 0.208 > 0.1
    assert ev["entropy_collapse"] == 15
    assert ev["grad_spikes"] == [16] and ev["grad_norm_max"] == 9.0
    steady = rep.collapse_events(rep.load_run(str(_write_run(tmp_path / "d", [0.5] * 20) or tmp_path / "d")))
    assert steady["reward_halved"] is None and steady["entropy_collapse"] is None and steady["grad_spikes"] == []
    table = rep.events_table({("half", "dense"): [rep.load_run(str(tmp_path / "c")), rep.load_run(str(tmp_path / "d"))]})
    assert "| half | dense | 1/2 (rollout 11) | 1/2 (rollout 15) | 1 | 9 |" in table


def test_plot_from_fixture(study, tmp_path):
    _, rep = study
    _write_run(tmp_path / "e", [0.1 * i for i in range(12)], evals={0: {"dense": 0.2}, 12: {"dense": 0.4}})
    runs = {("quarter", "dense"): [rep.load_run(str(tmp_path / "e"))],
            ("half", "smd"): [rep.load_run(str(tmp_path / "e"))]}
    path = rep.plot_study(runs, {"quarter": 89, "half": 178}, str(tmp_path / "plots" / "study.png"))
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_recipe_flags_are_valid_for_every_variant(study, tmp_path):
    lh, _ = study
    import run

    (tmp_path / "x.jsonl").write_text('{"prompt": "ab;100+2*3=", "label": "106>ab"}\n')
    for variant in lh.VARIANTS:
        cfg = load_config(["--hf-checkpoint", str(tmp_path), "--prompt-data", str(tmp_path / "x.jsonl"),
                           *lh.RECIPE, *run.VARIANTS[variant], "--kv-budget", str(lh.BUDGETS["quarter"])])
        assert cfg.train.num_rollout >= 150 and cfg.kv.budget == lh.BUDGETS["quarter"]
        assert cfg.kv.method == ("none" if variant == "dense" else "rkv")
    assert lh.cells(["dense", "smd"], ["quarter"], [1, 2], [0]) == [
        ("dense", "quarter", 1, 0), ("smd", "quarter", 1, 0), ("dense", "quarter", 2, 0), ("smd", "quarter", 2, 0)]
    assert lh.cells(["dense"], ["quarter"], [1], [0, 7]) == [("dense", "quarter", 1, 0), ("dense", "quarter", 1, 7)]
    assert lh.cell_dir("o", "dense", "quarter", 1, 7) == os.path.join("o", "assets7", "quarter", "dense-seed1")
    assert lh.parse_label(lh.label("quarter", 7)) == ("quarter", 7) and lh.label("half", 0) == "half"
    drift = load_config(["--hf-checkpoint", str(tmp_path), "--prompt-data", str(tmp_path / "x.jsonl"), *lh.RECIPE,
                         *lh.ALL_VARIANTS["sparse_rl_drift"], "--eval-prompt-data", str(tmp_path / "x.jsonl")])
    assert drift.kv.adaptive and drift.correction.preset == "mis"
    seeded = lh.assets_config(7)
    assert seeded.seed == seeded.warm_start.seed == 7 and lh.assets_config(0) == lh.ASSETS


def test_drift_tables_from_a_fixture(study, tmp_path):
    """The guard's first alarm, the separation of dense's and naive's intervals, and the adaptive row."""
    lh, rep = study
    import long_horizon_drift as drift

    evals_dense = {0: {"dense": 0.01}, 10: {"dense": 0.05}, 20: {"dense": 0.30}}
    evals_naive = {0: {"dense": 0.01}, 10: {"dense": 0.03}, 20: {"dense": 0.02}}
    _write_run(tmp_path / "quarter" / "dense-seed1", [0.5] * 20, evals=evals_dense, n_prompts=128)
    _write_run(tmp_path / "quarter" / "naive_sparse-seed1", [0.5] * 20, evals=evals_naive, n_prompts=128)
    path = tmp_path / "quarter" / "naive_sparse-seed1" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:  # probes before rollouts 1 and 11: the second one completes the alarm
        if r["step"] in (1, 11) and "rollout/reward_mean" in r:
            r.update({"drift/reward_gap": 0.1, "drift/reward_gap_se": 0.02, "drift/compressed_frac": 0.5,
                      "drift/answer_agreement": 0.3, "drift/alarm": float(r["step"] == 11),
                      "perf/drift_probe_s": 36.0})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = {("quarter", v): [rep.load_run(str(tmp_path / "quarter" / f"{v}-seed1"))] for v in ("dense", "naive_sparse")}
    assert drift.separation(runs[("quarter", "dense")][0], runs[("quarter", "naive_sparse")][0]) == 20
    assert drift.first_alarm(runs[("quarter", "naive_sparse")][0]) == 11
    sep = drift.separation_table(runs).splitlines()[2]
    assert sep == "| quarter | 1 | 20 | 0.300 / 0.020 | 10 | +10 |"
    guard = drift.guard_table(runs).splitlines()[2]
    assert guard.startswith("| quarter | naive_sparse | 1 | 2 | 11 | 1 | +0.100 ± 0.020 |") and "| 1.0 % |" in guard


@pytest.mark.timeout(900)
def test_micro_cell_runs_resumes_and_reports(study, tmp_path, monkeypatch, capsys):
    """A micro cell (a 1-layer model, 2-3-step answers) through the study's own commands: run, rerun (resumes:
    nothing to do), report."""
    lh, rep = study
    from slime_sparse.tasks.assets import AssetsConfig
    from slime_sparse.tasks.long_recall import LongRecallConfig
    from slime_sparse.tasks.tiny_model import TinyModelConfig
    from slime_sparse.tasks.warm_start import WarmStartConfig

    monkeypatch.setattr(lh, "ASSETS", AssetsConfig(
        task=LongRecallConfig(min_count=2, max_count=3),
        model=TinyModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64),
        warm_start=WarmStartConfig(steps=2, batch_size=4), n_train=64, n_test=8))
    monkeypatch.setattr(lh, "BUDGETS", {"quarter": 12, "half": 24})
    common = ["--out", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache")]
    flags = ["--", "--num-rollout", "2", "--eval-interval", "1", "--eval-max-prompts", "4", "--rollout-batch-size",
             "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--rollout-max-response-len", "48",
             "--kv-buffer", "4", "--kv-window", "4", "--mismatch-metrics-interval", "1"]
    cell = ["cell", "--variant", "sparse_rl", "--budget", "quarter", "--seed", "3", *common, *flags]
    assert lh.main(cell) == 0
    run_dir = lh.cell_dir(str(tmp_path / "runs"), "sparse_rl", "quarter", 3)
    assert rep.is_complete(run_dir, 2) and not rep.is_complete(run_dir, 3) and rep.last_step(run_dir) == 2
    assert lh.main(cell) == 0  # complete: nothing to do, one more time record
    times = rep.load_run(run_dir).times
    assert [(t["from_rollout"], t["to_rollout"]) for t in times] == [(0, 2), (2, 2)]
    assert lh.main(["parts", "--variants", "sparse_rl", "--budgets", "quarter", *common]) == 0
    out = capsys.readouterr().out
    assert "| quarter (B=12) | sparse_rl | 1 | 2 |" in out and "| quarter | sparse_rl | 0/1 | " in out
    assert os.path.isfile(tmp_path / "runs" / "long_horizon.png")
    with open(os.path.join(run_dir, "parts.json"), encoding="utf-8") as fh:
        parts = json.load(fh)
    assert parts["rollout"] == 2 and parts["dense"]["prompts"] == parts["sparse"]["prompts"] == 8  # all 8 test prompts
    for mode in ("dense", "sparse"):
        assert 0.0 <= parts[mode]["worked"] <= 1.0 and 0.0 <= parts[mode]["full"] <= parts[mode]["total"] + 1e-9
    assert os.path.isfile(tmp_path / "runs" / "quarter" / "warm_start_parts.json")
    assert "| quarter | warm start | 1 | 0 |" in out and "| quarter | sparse_rl | 1 | 2 |" in out


def test_mechanism_first_token_coefficients_against_their_formulas(study):
    """The mechanism probe's c_i = -dLoss/dlog pi(first token), through the project's loss, against the closed forms:
    A_i / len_i (naive, seq-mean-token-mean, scaled by the batch), A_i / 440 (token-sum), A_i prod xi / len_i
    (sequence IS), min(prod xi, 2) when truncated; and the push as sum_i c_i (1[worked] - P_p) per prompt."""
    import random

    import torch

    import long_horizon_mechanism as mech
    from slime_sparse.algo import AdvantageSpec, compute_advantages

    rng = random.Random(0)
    rows = []
    for p in range(3):
        for _ in range(4):
            n = rng.choice([3, 10, 40])
            sparse = [rng.uniform(-2.0, -0.1) for _ in range(n)]
            old = [x + (0.0 if t == 0 else rng.uniform(-0.5, 0.5)) for t, x in enumerate(sparse)]  # xi = 1 first
            rows.append({"prompt": p, "response_ids": [rng.choice([5, 9])] * n, "logp_sparse": sparse,
                         "logp_old": old, "reward": rng.choice([0.0, 0.4, 1.0])})
    lens = torch.tensor([len(r["response_ids"]) for r in rows], dtype=torch.float32)
    adv, _ = compute_advantages(torch.tensor([r["reward"] for r in rows]), torch.tensor([r["prompt"] for r in rows]),
                                lens.long(), AdvantageSpec())
    seq_w = torch.tensor([sum(o - s for o, s in zip(r["logp_old"], r["logp_sparse"])) for r in rows]).exp()
    coef = {name: mech.first_token_coefficients(rows, name, sparse=True) for name in mech.ESTIMATORS}
    assert torch.allclose(coef["naive"], adv / lens, atol=1e-6)
    assert torch.allclose(coef["SMD"], coef["naive"]) and torch.allclose(coef["paper"], coef["naive"], atol=1e-6)
    assert torch.allclose(coef["token-sum aggregation"], adv / mech.MAX_LEN, atol=1e-7)
    assert torch.allclose(coef["seq IS, untruncated"], adv * seq_w / lens, rtol=1e-4, atol=1e-6)
    assert torch.allclose(coef["seq IS, truncated at 2"], adv * seq_w.clamp(max=2.0) / lens, rtol=1e-4, atol=1e-6)
    p_worked = torch.tensor([0.5, 0.2, 0.9])
    mean, lo, hi = mech.push(rows, coef["naive"], p_worked, hash_id=9)
    worked = torch.tensor([float(r["response_ids"][0] != 9) for r in rows])
    per = [sum(coef["naive"][i] * (worked[i] - p_worked[p]) for i in range(4 * p, 4 * p + 4)) for p in range(3)]
    assert mean == pytest.approx(float(sum(per) / 3), abs=1e-6) and lo < mean < hi
