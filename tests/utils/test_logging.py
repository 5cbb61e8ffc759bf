"""MetricsLogger (jsonl, resume truncation, non-finite values, TensorBoard, W&B by flag) and progress bars."""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import types

import numpy as np
import pytest
import torch

from slime_sparse.utils.logging import METRICS_FILE, MetricsLogger, Progress, WandbSettings, progress_bar, read_metrics


def strict_records(run_dir) -> list[dict]:
    """Parse metrics.jsonl rejecting NaN/Infinity literals, which are not JSON."""

    def reject(token):
        raise AssertionError(f"non-JSON constant {token} in metrics.jsonl")

    with open(os.path.join(run_dir, METRICS_FILE), encoding="utf-8") as fh:
        return [json.loads(line, parse_constant=reject) for line in fh]


def test_records_are_flushed_per_call_and_typed(tmp_path):
    log = MetricsLogger(str(tmp_path), use_tensorboard=False)
    log.log(0, {"rollout/reward_mean": 0.25, "n": 3, "flag": True, "t": torch.tensor(1.5), "np": np.float32(0.5)})
    log.log(0, {"eval/acc": 0.5})  # a second record at the same step is fine
    # Readable before close: each call is flushed.
    records = strict_records(tmp_path)
    assert [r["step"] for r in records] == [0, 0]
    first = {k: v for k, v in records[0].items() if k != "time"}
    assert first == {"step": 0, "rollout/reward_mean": 0.25, "n": 3, "flag": 1, "t": 1.5, "np": 0.5}
    assert records[1]["eval/acc"] == 0.5
    log.close()
    log.close()  # idempotent


def test_non_finite_values_become_null_counted_and_warned_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="slime_sparse.utils.logging"):
        with MetricsLogger(str(tmp_path), use_tensorboard=False) as log:
            log.log(1, {"a": float("nan"), "b": float("inf"), "c": 2.0, "d": torch.tensor(float("-inf"))})
            log.log(2, {"a": math.nan, "c": 3.0})
            assert log.nonfinite_counts == {"a": 2, "b": 1, "d": 1}

    records = strict_records(tmp_path)
    assert [(r["a"], r.get("b", "absent"), r["c"]) for r in records] == [(None, None, 2.0), (None, "absent", 3.0)]
    assert records[0]["d"] is None
    assert caplog.text.count("metric 'a' is nan") == 1  # warned once per key, then counted
    assert "{'a': 2, 'b': 1, 'd': 1}" in caplog.text  # summary at close


def test_resume_drops_lines_at_or_after_start_step(tmp_path):
    with MetricsLogger(str(tmp_path), use_tensorboard=False) as log:
        for step in range(6):
            log.log(step, {"x": float(step)})
            if step == 3:
                log.log(step, {"eval/acc": 0.5})  # two records at step 3: both dropped
    with open(tmp_path / METRICS_FILE, "a", encoding="utf-8") as fh:
        fh.write('{"step": 6, "x": 6.0')  # a line torn by a crash mid-write

    with MetricsLogger(str(tmp_path), use_tensorboard=False, start_step=3) as log:
        assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2]
        log.log(3, {"x": 30.0})
        log.log(4, {"x": 40.0})
    records = strict_records(tmp_path)
    assert [(r["step"], r["x"]) for r in records] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]

    MetricsLogger(str(tmp_path), use_tensorboard=False).close()  # a fresh run (start_step 0) starts empty
    assert read_metrics(str(tmp_path)) == []


def test_invalid_calls_raise(tmp_path):
    with MetricsLogger(str(tmp_path), use_tensorboard=False) as log:
        log.log(5, {"x": 1.0})
        with pytest.raises(ValueError, match="below the last logged step 5"):
            log.log(4, {"x": 1.0})
        with pytest.raises(ValueError, match="'s' must be a number"):
            log.log(5, {"s": "text"})
        with pytest.raises(ValueError, match="must be a scalar"):
            log.log(5, {"v": torch.ones(3)})
        with pytest.raises(ValueError, match="other than"):
            log.log(5, {"step": 1})
    with pytest.raises(ValueError, match="start_step"):
        MetricsLogger(str(tmp_path), start_step=-1)


def test_tensorboard_scalars_skip_non_finite_and_purge_on_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(str(tmp_path), use_tensorboard=True) as log:
        for step in range(4):
            log.log(step, {"rollout/reward_mean": 0.1 * step, "mismatch/k3": float("nan") if step == 1 else 0.01})
    with MetricsLogger(str(tmp_path), use_tensorboard=True, start_step=2) as log:
        log.log(2, {"rollout/reward_mean": 0.9})

    acc = EventAccumulator(os.path.join(tmp_path, "tensorboard"))
    acc.Reload()
    reward = [(e.step, e.value) for e in acc.Scalars("rollout/reward_mean")]
    assert reward == [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.9))]  # step 3 purged, 2 redone
    assert [e.step for e in acc.Scalars("mismatch/k3")] == [0]  # nan at 1 skipped, 2 and 3 purged


def test_wandb_is_optional_and_resumes_the_same_run(tmp_path, monkeypatch):
    calls: list = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", dict(data), step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)

    with MetricsLogger(str(tmp_path), use_tensorboard=False, wandb=WandbSettings(project="proj")) as log:
        log.log(1, {"a": 1.0, "b": float("nan")})
    run_id = (tmp_path / "wandb_run_id").read_text().strip()  # a resumed run must reuse the stored id
    MetricsLogger(str(tmp_path), use_tensorboard=False, wandb=WandbSettings(project="proj"), start_step=2).close()

    inits = [c[1] for c in calls if c[0] == "init"]
    assert [(kw["id"], kw["project"], kw["resume"]) for kw in inits] == [(run_id, "proj", "allow")] * 2
    assert len(run_id) == 8 and run_id.isalnum()
    assert ("log", {"a": 1.0}, 1) in calls  # non-finite values are not sent
    assert calls.count(("finish",)) == 2

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ImportError, match="wandb"):
        MetricsLogger(str(tmp_path / "other"), use_tensorboard=False, wandb=WandbSettings())


# ----------------------------------------------------------------------------------------------- progress


def test_progress_logs_lines_when_not_a_tty(caplog):
    seen = []
    with caplog.at_level(logging.INFO, logger="slime_sparse.progress"):
        bar = progress_bar(range(2, 5), desc="rollouts", initial=2, tty=False, log_interval_s=0.0)
        for i in bar:
            seen.append(i)
            bar.set_postfix(reward=f"{i / 10:.2f}")
    assert seen == [2, 3, 4]
    lines = [r.getMessage() for r in caplog.records if r.name == "slime_sparse.progress"]
    assert [line.split(" ")[1] for line in lines] == ["3/5", "4/5", "5/5"]  # resumed at 2, counts to 5
    assert lines[-1].startswith("rollouts: 5/5 (100%)") and lines[-1].endswith("| reward=0.40")


def test_progress_rate_limits_and_can_be_disabled(caplog):
    with caplog.at_level(logging.INFO, logger="slime_sparse.progress"):
        with Progress(total=4, desc="slow", tty=False, log_interval_s=3600.0) as bar:
            for _ in range(4):
                bar.update()
        assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["slow: 4/4"]  # only the final line
        caplog.clear()
        assert list(progress_bar([1, 2], enabled=False, tty=False, log_interval_s=0.0)) == [1, 2]
        assert caplog.records == []


def test_progress_uses_tqdm_on_a_tty(capsys):
    bar = progress_bar(range(3), desc="tty-bar", tty=True)
    assert list(bar) == [0, 1, 2]
    err = capsys.readouterr().err
    assert "tty-bar" in err and "3/3" in err
