"""A second invocation never damages a run directory: a failed rerun writes nothing, a rerun of a finished run
changes nothing, a changed experiment is refused, a corrupt checkpoint is skipped, another model's is one line;
SIGTERM / Ctrl-C end a run cleanly with the summary saying so, saving the last finished rollout; output paths
that cannot be written are one line before anything is written."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from slime_sparse.train import main
from slime_sparse.utils.checkpoint import read_trainer_state
from tests.helpers.tiny_runs import comparable, rollout_rows, run_args


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(n_train=64)


def snapshot(run_dir) -> dict[str, str]:
    """Every file under the run directory with a hash of its content and its mtime."""
    out = {}
    for root, _, files in os.walk(run_dir):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, run_dir)] = f"{hashlib.sha1(fh.read()).hexdigest()} {os.stat(path).st_mtime_ns}"
    return out


def one_line_error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


@pytest.fixture(scope="module")
def finished(assets, tmp_path_factory):
    """A finished 2-rollout run (checkpoints after rollouts 1 and 2), copied fresh for each test that changes it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert main(run_args(assets, run, 2)) == 0
    return run


@pytest.fixture
def run(finished, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


def test_a_failed_rerun_writes_nothing(assets, run, capsys):
    before = snapshot(run)
    # too few prompts for 1000 rollouts: found while the run is built, after the config was written before
    assert main(run_args(assets, run, 1000)) == 2
    assert "--num-rollout" in one_line_error(capsys)
    assert snapshot(run) == before


def test_rerunning_a_finished_run_changes_nothing_and_raising_num_rollout_extends_it(assets, run, capsys):
    before = snapshot(run)
    assert main(run_args(assets, run, 2)) == 0
    assert "the run is complete" in capsys.readouterr().err
    assert snapshot(run) == before
    assert json.loads((run / "summary.json").read_text())["status"] == "complete"

    assert main(run_args(assets, run, 3)) == 0
    assert [r["step"] for r in rollout_rows(run)] == [1, 2, 3]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["last_rollout"] == 3


def test_resuming_a_changed_experiment_is_refused_unless_allowed(assets, run, capsys):
    before = snapshot(run)
    assert main(run_args(assets, run, 3, "--kv-budget", "12", "--eps-clip", "0.1")) == 2
    err = one_line_error(capsys)
    assert "--kv-budget 16 -> 12" in err and "--eps-clip 0.2 -> 0.1" in err and "--allow-config-change" in err
    assert snapshot(run) == before
    # schedule and logging may change freely
    assert main(run_args(assets, run, 3, "--save-interval", "2", "--eval-interval", "5")) == 0
    assert main(run_args(assets, run, 4, "--kv-budget", "12", "--allow-config-change")) == 0
    assert "warning: resuming" in capsys.readouterr().err
    assert [r["step"] for r in rollout_rows(run)] == [1, 2, 3, 4]


def test_a_corrupt_latest_checkpoint_is_skipped_for_the_previous_one(assets, run, capsys):
    weights = run / "checkpoints" / "rollout_000002" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated, still marked complete
    assert main(run_args(assets, run, 3)) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert any("model.safetensors is unreadable" in w and "rollout_000001" in w for w in warnings), warnings
    # resumed from rollout 1: rollout 2 was redone, its old metrics line replaced
    assert [r["step"] for r in rollout_rows(run)] == [1, 2, 3]


def test_a_checkpoint_of_another_model_is_one_line_naming_the_tensor(assets, run, capsys):
    for step in (1, 2):
        weights = run / "checkpoints" / f"rollout_{step:06d}" / "model" / "model.safetensors"
        tensors = load_file(str(weights))
        name = sorted(tensors)[0]
        tensors[name] = torch.zeros(*(d + 1 for d in tensors[name].shape))
        save_file(tensors, str(weights))
    assert main(run_args(assets, run, 3)) == 2
    err = one_line_error(capsys)
    assert name in err and "another model" in err


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_the_run_cleanly(assets, tmp_path, sig, code):
    run = tmp_path / "run"
    argv = run_args(assets, run, 30, "--rm-num-workers", "2")  # far more rollouts than the test waits for
    proc = subprocess.Popen([sys.executable, "-m", "slime_sparse.train", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not ((run / "metrics.jsonl").exists() and rollout_rows(run)):
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.5)
        workers = _children(proc.pid)
        assert len(workers) == 2  # the grader processes
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert summary["last_rollout"] == max(r["step"] for r in rollout_rows(run)) >= 1
    assert all(not os.path.exists(f"/proc/{pid}") for pid in workers)
    json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])  # flushed, not torn


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(p) for p in fh.read().split()]



def test_experiment_changes_name_experiment_fields_only():
    import dataclasses

    from slime_sparse.config import RunConfig
    from slime_sparse.resume import checkpoint_config, experiment_changes

    base = RunConfig()
    saved = checkpoint_config(base)
    schedule = dataclasses.replace(base, train=dataclasses.replace(base.train, num_rollout=7, save_interval=3),
                                   data=dataclasses.replace(base.data, num_epochs=4),
                                   log=dataclasses.replace(base.log, progress=False))
    assert experiment_changes(saved, checkpoint_config(schedule)) == []
    experiment = dataclasses.replace(base, train=dataclasses.replace(base.train, hf_checkpoint="other"),
                                     kv=dataclasses.replace(base.kv, budget=64))
    assert experiment_changes(saved, checkpoint_config(experiment)) == ["--kv-budget 512 -> 64",
                                                                        "--hf-checkpoint unset -> other"]
    assert experiment_changes(None, checkpoint_config(experiment)) == []  # a checkpoint from before configs


def test_a_stop_saves_the_last_finished_rollout_and_the_rerun_resumes_it_exactly(assets, tmp_path, capsys):
    """SIGTERM during rollout 3's generation (from a filter, at a known point): rollout 2 is saved although no
    checkpoint was due, the messages say so, and the rerun resumes from it to the same metrics as a run that was
    never stopped, with no metrics line lost."""
    from tests.helpers import tiny_runs

    stop = ("--dynamic-sampling-filter-path", "tests.helpers.tiny_runs:signal_at", "--save-interval", "0")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert main(run_args(assets, straight, 3, *stop)) == 0
    tiny_runs.STOP_AT.update(prompt_index=4, signal=signal.SIGTERM)  # the first group of rollout 3 (2 prompts each)
    assert main(run_args(assets, stopped, 3, *stop)) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    checkpoint = stopped / "checkpoints" / "rollout_000002"
    assert "SIGTERM: saving rollout 2, the last finished one" in err
    assert f"stopped after rollout 2: rerun the command to resume from {checkpoint}" in err
    assert checkpoint.is_dir() and json.loads((stopped / "summary.json").read_text())["last_rollout"] == 2
    assert [r["step"] for r in rollout_rows(stopped)] == [1, 2]

    assert main(run_args(assets, stopped, 3, *stop)) == 0
    assert [r["step"] for r in rollout_rows(stopped)] == [1, 2, 3]  # no line dropped, none repeated
    assert [comparable(r) for r in rollout_rows(stopped)] == [comparable(r) for r in rollout_rows(straight)]


def test_a_stop_during_the_optimizer_steps_finishes_the_rollout_first(assets, tmp_path, capsys, monkeypatch):
    """A signal while the learner is changing is held until the rollout is trained and logged; then that rollout
    is saved: a checkpoint never holds half of a rollout's updates."""
    from slime_sparse.backends.embedded.learner import EmbeddedLearner

    real, calls = EmbeddedLearner.train_step, []

    def train_step(self, batch):
        calls.append(1)
        if len(calls) == 3:  # rollout 2's first of its 2 optimizer steps
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, batch)

    monkeypatch.setattr(EmbeddedLearner, "train_step", train_step)
    run = tmp_path / "run"
    assert main(run_args(assets, run, 5, "--save-interval", "0")) == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert "SIGINT: finishing the rollout in training, then saving it and stopping" in err
    assert len(calls) == 4 and [r["step"] for r in rollout_rows(run)] == [1, 2]
    assert read_trainer_state(str(run / "checkpoints" / "rollout_000002"))["step"] == 2


def test_output_paths_are_checked_before_anything_is_written(assets, tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    for flags, flag in ((["--run-dir", str(blocker / "run")], "--run-dir"),
                        (["--save", str(blocker / "ckpt")], "--save")):
        run = tmp_path / "run"
        assert main(run_args(assets, run, 1) + flags) == 2
        assert one_line_error(capsys).startswith(f"error: {flag} ") and not run.exists()
    # a directory the process may not write (simulated: the tests run as root, who may write anywhere)
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(locked) else real_access(p, mode))
    assert main(run_args(assets, locked / "run", 1)) == 2
    assert one_line_error(capsys) == f"error: --run-dir {locked / 'run'}: cannot be created ({locked} is not writable)"
    assert list(locked.iterdir()) == []


def test_the_run_directory_is_named_at_start(assets, tmp_path, capsys):
    run, save = tmp_path / "run", tmp_path / "elsewhere"
    assert main(run_args(assets, run, 1, "--save", str(save))) == 0
    assert f"run directory: {run} (config.yaml, metrics.jsonl, summary.json); checkpoints: {save}" in \
        capsys.readouterr().err
