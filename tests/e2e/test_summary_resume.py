"""summary.json keeps every evaluation across an interrupt and a resume (#45: a resumed run lost rollout 0's)."""
from __future__ import annotations

import json
import signal

import pytest

from tests.helpers import tiny_runs
from tests.helpers.tiny_runs import run_args
from slime_sparse.train import main


@pytest.fixture
def assets(tiny_assets):
    return tiny_assets(n_train=64)


def summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_an_interrupt_after_the_first_evaluation_loses_no_evaluation(assets, tmp_path, capsys):
    """Evaluations at 0, 2 and 3 (--eval-interval 2 of 3 rollouts); SIGINT during rollout 2 (after the evaluation
    at 0 and rollout 1's checkpoint); the resume evaluates at 2 and 3 and keeps 0, and the first rollout's metrics."""
    run = tmp_path / "run"
    flags = run_args(assets, run, 3, "--eval-prompt-data", str(assets.test_path), "--eval-interval", "2",
                     "--dynamic-sampling-filter-path", "tests.helpers.tiny_runs:signal_at")
    tiny_runs.STOP_AT.update(prompt_index=2, signal=signal.SIGINT)  # rollout 2's first group (2 prompts a rollout)
    assert main(flags) == 128 + signal.SIGINT
    stopped = summary(run)
    assert stopped["status"] == "interrupted" and stopped["last_rollout"] == 1
    assert list(stopped["evals"]) == ["0"] and stopped["first"]["rollout/reward_mean"] is not None

    assert main(flags) == 0
    resumed = summary(run)
    assert resumed["status"] == "complete" and list(resumed["evals"]) == ["0", "2", "3"]
    assert resumed["evals"]["0"] == stopped["evals"]["0"]  # the first process's evaluation, kept as it was
    assert set(resumed["evals"]["2"]) == {"dense", "sparse"}
    assert resumed["first"] == stopped["first"]  # rollout 1's metrics, not the resume's first rollout


def test_summary_json_holds_each_evaluation_as_soon_as_it_is_done(assets, tmp_path, monkeypatch):
    """A kill -9 between evaluations loses none that finished: summary.json is rewritten after each."""
    import slime_sparse.train as train_module

    seen = []
    real = train_module.evaluate_modes

    def evaluate_modes(cfg, components, *, step, logger=None):
        if step == 2:  # the previous evaluation (0) is already on disk
            seen.append(list(summary(tmp_path / "run")["evals"]))
        return real(cfg, components, step=step, logger=logger)

    monkeypatch.setattr(train_module, "evaluate_modes", evaluate_modes)
    assert main(run_args(assets, tmp_path / "run", 2, "--eval-prompt-data", str(assets.test_path),
                         "--eval-interval", "2")) == 0
    assert seen == [["0"]]
