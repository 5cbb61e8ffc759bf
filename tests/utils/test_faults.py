"""Fault injection (slime_sparse/utils/faults.py) and what a real kill -9 at each write point leaves behind.

The whole-run version of these (kills at random moments of the tiny recipe, resumed and compared bit for bit
with an uninterrupted run) is the chaos test, tests/e2e/test_chaos.py (`pytest -m chaos`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from slime_sparse.utils import faults
from slime_sparse.utils.checkpoint import latest_checkpoint, list_checkpoints, load_training_state, tidy_save_dir
from slime_sparse.utils.logging import MetricsLogger, read_metrics


@pytest.fixture
def restore_faults():
    yield
    faults.configure()  # back to this process's environment (unarmed)


def test_parse_and_configure(tmp_path, restore_faults):
    assert faults.parse_faults("engine.step@40,metrics.write@2") == {"engine.step": 40, "metrics.write": 2}
    for bad in ("engine.step", "nowhere@1", "engine.step@0", "engine.step@1,engine.step@2", "metrics.write@x"):
        with pytest.raises(ValueError, match=faults.FAULT_ENV):
            faults.parse_faults(bad)
    with pytest.raises(ValueError, match=faults.RECORD_ENV):
        faults.configure({faults.FAULT_ENV: "engine.step@1"})
    trace = tmp_path / "trace"
    faults.configure({faults.TRACE_ENV: str(trace)})
    for name in ("engine.step", "engine.step", "learner.backward", "engine.step"):
        faults.fault_point(name)
    assert [line.split()[1] for line in trace.read_text().splitlines()] == ["engine.step", "learner.backward",
                                                                            "engine.step"]


def test_an_existing_record_disarms_the_fault(tmp_path, restore_faults):
    (tmp_path / "metrics.write@1.json").write_text("{}")  # fired before, in another process
    faults.configure({faults.FAULT_ENV: "metrics.write@1", faults.RECORD_ENV: str(tmp_path)})
    faults.fault_point("metrics.write")  # would SIGKILL this test process if armed


CHILD = textwrap.dedent("""
    import sys, torch
    from slime_sparse.utils.checkpoint import save_training_state
    from slime_sparse.utils.logging import MetricsLogger
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    save_dir, run_dir = sys.argv[1], sys.argv[2]
    with MetricsLogger(run_dir, use_tensorboard=False) as log:
        for step in range(1, 5):
            model(torch.randn(4, 3)).sum().backward()
            opt.step()
            log.log(step, {"loss": float(step)})
            torch.save(model.state_dict(), f"{save_dir}/../weights_{step}.pt")
            save_training_state(f"{save_dir}/rollout_{step:06d}", model=model, optimizer=opt, step=step,
                                data_state={"consumed": step}, keep_last=2)
""")


@pytest.mark.parametrize("point, hit, resume_step, visible", [
    ("checkpoint.staged", 3, 2, [1, 2]),  # files written, not complete: step 3 must stay invisible
    ("checkpoint.renamed", 3, 2, [1, 2, 3]),  # complete, but `latest` still names step 2: that one is loaded
    ("checkpoint.prune", 2, 4, [3, 4]),  # killed while deleting step 2 (after saving 4): 4 is loaded
    ("metrics.write", 3, 2, [1, 2]),  # a torn metrics line at step 3
])
def test_kill_9_at_a_write_point_leaves_a_loadable_run(tmp_path, point, hit, resume_step, visible):
    save_dir, run_dir, records = tmp_path / "ckpt", tmp_path / "run", tmp_path / "records"
    save_dir.mkdir()
    env = dict(os.environ, **{faults.FAULT_ENV: f"{point}@{hit}", faults.RECORD_ENV: str(records)})
    child = subprocess.run([sys.executable, "-c", CHILD, str(save_dir), str(run_dir)], env=env, timeout=300)
    assert child.returncode == -signal.SIGKILL
    assert json.loads((records / f"{point}@{hit}.json").read_text())["point"] == point

    latest = latest_checkpoint(str(save_dir))
    step = int(os.path.basename(latest).split("_")[1])
    assert step == resume_step
    model = torch.nn.Linear(3, 2)
    state = load_training_state(latest, model, torch.optim.AdamW(model.parameters(), lr=0.1), restore_rng=False)
    assert state["data_state"] == {"consumed": resume_step}
    saved = torch.load(tmp_path / f"weights_{resume_step}.pt", weights_only=True)
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved)
    assert [s for s, _ in list_checkpoints(str(save_dir))] == visible
    # the restarted run finishes what the killed one left (also when no later save comes): no tmp-* directory,
    # keep_last checkpoints, `latest` unchanged
    tidy_save_dir(str(save_dir), keep_last=2)
    assert not [p.name for p in save_dir.iterdir() if p.name.startswith("tmp-")]
    assert [s for s, _ in list_checkpoints(str(save_dir))] == visible[-2:]
    assert latest_checkpoint(str(save_dir)) == latest

    # the resumed run's logger drops what came after the checkpoint, torn line included: each step once
    with MetricsLogger(str(run_dir), use_tensorboard=False, start_step=resume_step + 1) as log:
        log.log(resume_step + 1, {"loss": 0.0})
    assert [r["step"] for r in read_metrics(str(run_dir))] == list(range(1, resume_step + 2))


def test_chaos_driver_defers_a_prune_kill_the_last_rollout_cannot_reach():
    """Found by the first full chaos run: a prune armed in the run's last rollout never fired (nothing to prune),
    the run completed, and 8 of the 20 planned kills never landed."""
    from tests.helpers.chaos import STANDBY, next_fault

    specs = ["checkpoint.prune", "metrics.write", "checkpoint.prune"]
    assert next_fault(specs, 0, remaining=1) == "metrics.write"
    assert specs == ["metrics.write", "checkpoint.prune", "checkpoint.prune"]  # deferred, not dropped
    assert next_fault(specs, 1, remaining=2) == "checkpoint.prune"
    assert next_fault(specs, 2, remaining=1) == STANDBY  # nothing left that can land: a point every rollout reaches
    assert next_fault(["external"], 0, remaining=1) == "external"
