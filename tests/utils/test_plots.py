"""Curves from metrics.jsonl: series extraction, EMA, PNG output, and the tools/plot_metrics.py command."""
from __future__ import annotations

import importlib.util
import math
import os

import pytest

from slime_sparse.utils.logging import MetricsLogger
from slime_sparse.utils.plots import (
    DEFAULT_PLOT_KEYS, EVAL_ACCURACY_KEY, ema, metric_series, panel_series, plot_metrics,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_tool():
    spec = importlib.util.spec_from_file_location("plot_metrics_tool", os.path.join(REPO, "tools", "plot_metrics.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(run_dir, steps: int = 12) -> None:
    with MetricsLogger(str(run_dir), use_tensorboard=False) as log:
        for s in range(steps):
            log.log(s, {
                "rollout/reward_mean": 0.2 + 0.05 * s,
                "kv/savings": 0.4 if s != 3 else float("nan"),  # a null in the middle
                "correction/seq_reject_rate": 0.07 * math.sin(s) ** 2,
            })


def assert_png(path: str) -> None:
    from matplotlib.image import imread

    with open(path, "rb") as fh:
        assert fh.read(8) == PNG_MAGIC
    pixels = imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels[..., :3].std() > 0.01  # something was drawn, not a blank canvas


def test_metric_series_skips_nulls_and_keeps_last_duplicate():
    records = [
        {"step": 2, "a": 2.0},
        {"step": 0, "a": 0.0},
        {"step": 1, "a": None},
        {"step": 2, "a": 5.0},  # the same step logged again (e.g. redone): last wins
        {"step": 3, "b": 1.0},
    ]
    assert metric_series(records, "a") == ([0, 2], [0.0, 5.0])
    assert metric_series(records, "missing") == ([], [])


def test_ema_matches_hand_computation():
    assert ema([0.0, 10.0, 10.0], 0.5) == [0.0, 5.0, 7.5]
    assert ema([1.0, 2.0], 0.0) == [1.0, 2.0]
    with pytest.raises(ValueError):
        ema([1.0], 1.0)


def test_plot_metrics_writes_pngs_and_reports_missing_keys(tmp_path):
    write_run(tmp_path)
    result = plot_metrics(str(tmp_path), smooth=0.6)

    # default keys the run did not log
    assert result.missing_keys == [EVAL_ACCURACY_KEY, "mismatch/k3", "mismatch/sparsity/k3", "mismatch/numeric/k3",
                                   "mismatch/xi_p5", "drift/reward_gap",
                                   "correction/is_ess", "rollout/effective_batch_size",
                                   "rollout/gen_tokens_per_train_token"]
    names = [os.path.basename(f) for f in result.files]
    assert names == ["rollout_reward_mean.png", "kv_savings.png", "correction_seq_reject_rate.png", "summary.png"]
    for f in result.files:
        assert os.path.dirname(f) == os.path.join(str(tmp_path), "plots")
        assert_png(f)
    assert DEFAULT_PLOT_KEYS[:2] == (EVAL_ACCURACY_KEY, "rollout/reward_mean")  # the headline first


def test_plot_tool_cli(tmp_path, capsys):
    tool = load_tool()
    write_run(tmp_path)
    out_dir = tmp_path / "figs"

    assert tool.main([str(tmp_path), "--keys", "kv/savings", "nope/x", "--out-dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "note: 'nope/x' not found" in out
    assert sorted(os.listdir(out_dir)) == ["kv_savings.png", "summary.png"]
    assert_png(str(out_dir / "kv_savings.png"))

    assert tool.main([str(tmp_path), "--keys", "nope/x"]) == 1
    assert "the log has: correction/seq_reject_rate, kv/savings, rollout/reward_mean" in capsys.readouterr().err
    assert tool.main([str(tmp_path / "empty")]) == 2
    assert tool.main([str(tmp_path), "--smooth", "1.5"]) == 2


def test_eval_accuracy_panel_and_a_metric_of_some_rollouts_drawn_as_points(tmp_path):
    """The evaluation's pass@1 under every mode (and named set) in one panel; the mismatch split, logged every
    10th rollout, as points: a line through 2 points would invent the rollouts in between."""
    with MetricsLogger(str(tmp_path), use_tensorboard=False) as log:
        for s in range(0, 21):
            row = {"rollout/reward_mean": 0.3 + 0.01 * s} if s else {}
            if s % 10 == 1:
                row["mismatch/sparsity/k3"] = 0.08 + 0.001 * s
            if s % 5 == 0:
                row.update({"eval_dense/pass@1": 0.3 + 0.03 * s, "eval_sparse/pass@1": 0.2 + 0.02 * s,
                            "eval_dense/gsm8k/pass@1": 0.1, "eval_dense/avg@1": 0.5})
            log.log(s, row)
    from slime_sparse.utils.logging import read_metrics

    curves = panel_series(read_metrics(str(tmp_path)), EVAL_ACCURACY_KEY)
    assert [(label, steps) for label, steps, _ in curves] == [
        ("dense", [0, 5, 10, 15, 20]), ("dense gsm8k", [0, 5, 10, 15, 20]), ("sparse", [0, 5, 10, 15, 20])]
    result = plot_metrics(str(tmp_path), keys=[EVAL_ACCURACY_KEY, "mismatch/sparsity/k3", "rollout/reward_mean"])
    assert [os.path.basename(f) for f in result.files] == ["eval_pass_1.png", "mismatch_sparsity_k3.png",
                                                          "rollout_reward_mean.png", "summary.png"]
    for f in result.files:
        assert_png(f)

    drawn = {}

    class Axes:  # what _draw asks of matplotlib, recorded
        def plot(self, x, y, **kw):
            drawn.setdefault(self.key, []).append(kw)

        def get_legend_handles_labels(self):
            return [], [kw.get("label") for kws in drawn.get(self.key, []) for kw in [kws] if kw.get("label")]

        def legend(self, **kw):
            drawn[self.key + " legend"] = True

        def set_title(self, t):
            pass

        set_xlabel = set_title

        def grid(self, *a, **kw):
            pass

    from slime_sparse.utils import plots

    records = read_metrics(str(tmp_path))
    for key in (EVAL_ACCURACY_KEY, "mismatch/sparsity/k3", "rollout/reward_mean"):
        ax = Axes()
        ax.key = key
        plots._draw(ax, key, panel_series(records, key), 0.0)
    assert [kw["linestyle"] for kw in drawn["mismatch/sparsity/k3"]] == ["none"]  # points only
    assert all(kw.get("linestyle") != "none" and kw["marker"] == "o" for kw in drawn[EVAL_ACCURACY_KEY])
    assert [kw["label"] for kw in drawn[EVAL_ACCURACY_KEY]] == ["dense", "dense gsm8k", "sparse"]
    assert drawn[EVAL_ACCURACY_KEY + " legend"] and "linestyle" not in drawn["rollout/reward_mean"][0]
