"""End-to-end training on the embedded path: metrics present and finite, resume is exact."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from slime_sparse.train import main
from tests.helpers.tiny_runs import read_metrics
from tests.helpers.tiny_runs import run_args as args

# every metric family the run must log (docs/algorithm.md, "Metrics every run logs")
REQUIRED = [
    "rollout/reward_mean", "rollout/response_len_mean", "correction/seq_reject_rate", "correction/token_reject_rate",
    "correction/xi_mean", "correction/xi_min", "correction/xi_max", "correction/truncate_frac",
    "correction/mask_low_frac", "correction/mask_high_frac", "mismatch/k1", "mismatch/k3", "mismatch/chi2_token",
    "mismatch/chi2_seq", "mismatch/sampler_ppl", "mismatch/learner_ppl", "kv/savings", "kv/peak_tokens_max",
    "pg_clipfrac", "train/grad_norm", "train/loss", "kl_loss", "perf/rollout_s",
]


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(n_train=64)


def test_metrics_present_and_finite(assets, tmp_path):
    run = tmp_path / "run"
    assert main(args(assets, run, 2)) == 0
    rows = [r for r in read_metrics(run) if "rollout/reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in REQUIRED:
            assert key in row, key
            assert row[key] is not None and math.isfinite(row[key]), (key, row[key])
        assert row["kv/savings"] > 0  # responses outgrow the 16-token budget
        assert row["kv/peak_tokens_max"] <= 16 + 4
    assert (run / "summary.json").exists() and (run / "config.yaml").exists()


def final_weights(run_dir, step):
    path = run_dir / "checkpoints" / f"rollout_{step:06d}" / "model" / "model.safetensors"
    return load_file(str(path))


def test_resume_is_exact(assets, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(args(assets, straight, 4)) == 0
    assert main(args(assets, resumed, 2)) == 0  # "killed" after rollout 2 (last checkpoint: rollout 2)
    assert main(args(assets, resumed, 4)) == 0  # same command, longer horizon: resumes at rollout 2
    a, b = final_weights(straight, 4), final_weights(resumed, 4)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    state_a = json.loads((straight / "checkpoints" / "rollout_000004" / "trainer_state.json").read_text())
    state_b = json.loads((resumed / "checkpoints" / "rollout_000004" / "trainer_state.json").read_text())
    assert state_a["data_state"] == state_b["data_state"]  # same data position, nothing repeated or lost
    steps = [r["step"] for r in read_metrics(resumed) if "rollout/reward_mean" in r]
    assert steps == [1, 2, 3, 4]
    rewards_a = [r["rollout/reward_mean"] for r in read_metrics(straight) if "rollout/reward_mean" in r]
    rewards_b = [r["rollout/reward_mean"] for r in read_metrics(resumed) if "rollout/reward_mean" in r]
    assert rewards_a == rewards_b
    # the same command once more: nothing left to do, and nothing of the finished run is lost
    summary, metrics = (resumed / "summary.json").read_text(), (resumed / "metrics.jsonl").read_text()
    assert main(args(assets, resumed, 4)) == 0
    assert (resumed / "summary.json").read_text() == summary and (resumed / "metrics.jsonl").read_text() == metrics


def test_bad_flag_is_a_clear_error(assets, tmp_path, capsys):
    assert main(args(assets, tmp_path / "r", 1, "--kv-method", "bogus")) == 2
    assert "--kv-method" in capsys.readouterr().err


def test_malformed_data_row_is_one_line_without_traceback(assets, tmp_path, capsys):
    lines = assets.train_path.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:3] + ['{"prompt": "1 2=", "label": '] + lines[3:]) + "\n")
    argv = args(assets, tmp_path / "r", 1)
    argv[argv.index("--prompt-data") + 1] = str(bad)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    error_lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert error_lines == [f"error: --prompt-data {bad}: row 3 (0-based), line 4: not valid JSON "
                           "(Expecting value: line 1 column 29 (char 28))"]


def test_the_run_directory_is_printed_when_only_save_is_given(assets, tmp_path, capsys, monkeypatch):
    """slime users pass --save alone: the metrics then go to the default run directory, which the run says."""
    monkeypatch.chdir(tmp_path)
    argv = args(assets, tmp_path / "unused", 1, "--save", str(tmp_path / "ckpt"))
    i = argv.index("--run-dir")
    assert main(argv[:i] + argv[i + 2:]) == 0
    err = capsys.readouterr().err
    assert f"run directory: runs/default (config.yaml, metrics.jsonl, summary.json); checkpoints: {tmp_path / 'ckpt'}" \
        in err
    assert (tmp_path / "runs" / "default" / "metrics.jsonl").is_file() and (tmp_path / "ckpt").is_dir()
