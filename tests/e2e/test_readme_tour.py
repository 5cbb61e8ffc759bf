"""The README's five-minute tour, its commands read from the README and run as written in a fresh directory, the
Ctrl-C included (a SIGINT to the command's process group after the third rollout, as a terminal sends it).

Slow (the main job in full, a few minutes on 2 idle cores): `python -m pytest -q -m slow tests/e2e/test_readme_tour.py`.
The default run checks that the tour is the one this test runs.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = Path("runs/tour")
LAST = 12  # the main job's --num-rollout


def tour_commands() -> list[str]:
    """The commands of the README's tour block: continuation lines joined, comments dropped."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("### A five-minute tour"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands, current = [], ""
    for line in block.splitlines():
        current += " " + line.rstrip()
        if current.rstrip().endswith("\\"):
            current = current.rstrip()[:-1]
            continue
        words = shlex.split(current, comments=True)
        if words:
            commands.append(shlex.join(words))
        current = ""
    return commands


def test_the_tour_is_the_one_this_test_runs():
    commands = tour_commands()
    assert commands[:3] == [f"python examples/tiny_cpu/run.py --run-dir {RUN}"] * 3  # a fresh run directory
    assert [c.split()[0] for c in commands[3:]] == ["slime-sparse-eval", "slime-sparse-eval"]
    assert all(f"{RUN}/checkpoints/rollout_{LAST:06d}" in c and "--output reports/" in c for c in commands[3:])


def shims(where: Path) -> dict[str, str]:
    """`python` and `slime-sparse-eval` on PATH as a user's install has them, running this checkout."""
    where.mkdir()
    for name, target in (("python", ""), ("slime-sparse-eval", "-m slime_sparse.eval")):
        path = where / name
        path.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {target} "$@"\n')
        path.chmod(0o755)
    return dict(os.environ, PATH=f"{where}{os.pathsep}{os.environ['PATH']}",
                PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def snapshot(run_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}


def rollout_steps(run_dir: Path) -> list[int]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written while the run goes on
            pass
    return [r["step"] for r in rows if "rollout/reward_mean" in r]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_tour_runs_as_written(tmp_path):
    commands = tour_commands()
    work = tmp_path / "clone"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    (ROOT / ".cache" / "tiny_assets").mkdir(parents=True, exist_ok=True)
    (work / ".cache").mkdir()
    (work / ".cache" / "tiny_assets").symlink_to(ROOT / ".cache" / "tiny_assets")  # the warm start, built once
    env = shims(tmp_path / "bin")

    def run(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                              timeout=3000)

    # 1. trains; Ctrl-C after a few rollouts: the last finished one is saved
    proc = subprocess.Popen(["bash", "-c", commands[0]], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 3000
    while not ((work / RUN / "metrics.jsonl").exists() and len(rollout_steps(work / RUN)) >= 3):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGINT)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 130, out
    summary = json.loads((work / RUN / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["last_rollout"] >= 3
    newest = max(int(p.name.split("_")[1]) for p in (work / RUN / "checkpoints").glob("rollout_*"))
    assert newest == summary["last_rollout"], out  # the stop saved the last finished rollout

    # 2. the same command resumes from the newest checkpoint and finishes; every rollout logged once
    second = run(commands[1])
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"at rollout {newest}" in second.stdout + second.stderr
    assert rollout_steps(work / RUN) == list(range(1, LAST + 1))
    assert json.loads((work / RUN / "summary.json").read_text())["status"] == "complete"

    # 3. once more: complete, nothing changes
    before = snapshot(work / RUN)
    third = run(commands[2])
    assert third.returncode == 0 and "the run is complete" in third.stdout + third.stderr
    assert snapshot(work / RUN) == before

    # 4, 5. the evaluations: the final model's greedy pass@1 under R-KV and dense, as the run itself measured them
    rows = [json.loads(line) for line in (work / RUN / "metrics.jsonl").read_text().splitlines()]
    final = {k: v for r in rows if r["step"] == LAST for k, v in r.items()}
    for command, mode in zip(commands[3:], ("sparse", "dense")):
        done = run(command)
        assert done.returncode == 0, done.stdout + done.stderr
        report_path = work / shlex.split(command)[shlex.split(command).index("--output") + 1]
        report = json.loads(report_path.read_text())
        assert list(report) == ["test"] and done.stdout.strip() == report_path.read_text().strip()
        assert report["test"]["pass@1"] == pytest.approx(final[f"eval_{mode}/pass@1"]), mode
