"""--async (slime's train_async.py) end to end on the tiny task: rollout k + 1 generates while the learner trains on k,
the engines are updated every --update-weights-interval rollouts with generation drained first, staleness follows
the schedule, is bounded and logged per sample; partial rollouts carry unfinished groups across rollouts; a run
killed mid-async resumes with every sample trained once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_runs import rollout_rows, run_args

ROOT = Path(__file__).resolve().parents[2]
ASYNC = ["--async", "--rm-num-workers", "1"]


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(n_train=64)


class Spy:
    """The engine as the loop sees it, with a log of (what, start, end, thread) of every generate() and weight sync,
    and the learner's optimizer steps."""

    def __init__(self, engine, log: list) -> None:
        self._engine, self._log = engine, log

    def _timed(self, what: str, fn, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self._log.append((what, t0, time.monotonic(), threading.current_thread().name))

    def generate(self, *args, **kwargs):
        return self._timed("generate", self._engine.generate, *args, **kwargs)

    def sync_from(self, learner):
        return self._timed("sync", self._engine.sync_from, learner)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def spied_run(monkeypatch, argv):
    import slime_sparse.train as train_mod
    from slime_sparse.config_loader import load_config

    log: list = []
    build = train_mod.build_components

    def build_spied(cfg):
        components = build(cfg)
        components.engine = Spy(components.engine, log)
        learner_step = components.learner.train_step
        components.learner.train_step = lambda batch: _timed_call(log, "train", learner_step, batch)
        return components

    monkeypatch.setattr(train_mod, "build_components", build_spied)
    summary = train_mod.train(load_config(argv))
    return summary, log


def _timed_call(log, what, fn, *args):
    t0 = time.monotonic()
    try:
        return fn(*args)
    finally:
        log.append((what, t0, time.monotonic(), threading.current_thread().name))


def test_async_schedule_staleness_and_no_update_mid_generation(assets, tmp_path, monkeypatch):
    run = tmp_path / "run"
    summary, log = spied_run(monkeypatch, run_args(assets, run, 4, *ASYNC, "--update-weights-interval", "2",
                                                   "--max-staleness", "2", "--mismatch-metrics-interval", "1"))
    assert summary["status"] == "complete"
    rows = rollout_rows(run)
    # interval 2: rollout 1 is generated while rollout 0 trains (version 0, trained at 1), rollout 2 too (engines
    # still at 0, trained at 2: the last before an update), rollout 3 after the update at step 2 (version 2, at 3)
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 2, 1]
    assert [r["rollout/staleness_mean"] for r in rows] == [0, 1, 2, 1]
    assert [r["rollout/policy_version"] for r in rows] == [0, 2, 2, 4]  # what the engines hold after each step
    # the staleness part of the mismatch: pi_old now against the sampler's own weights, dense (the engine's model in
    # this process): nothing at staleness 0 (the same weights, fp32), something once the learner moved on
    assert abs(rows[0]["mismatch/staleness/k1"]) < 1e-6 and rows[0]["mismatch/staleness/abs_log_xi"] < 1e-5
    assert all(r["mismatch/staleness/abs_log_xi"] > 1e-4 for r in rows[1:])
    ledger = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["staleness"]) for r in ledger] == [(s, k) for s, k in zip(range(1, 5), [0, 1, 2, 1])
                                                             for _ in range(8)]
    assert len({r["prompt_index"] for r in ledger}) == 8  # 2 prompts x 4 rollouts, each trained once
    gens = [(a, b) for what, a, b, _ in log if what == "generate"]
    syncs = [(a, b) for what, a, b, _ in log if what == "sync"]
    trains = [(a, b) for what, a, b, _ in log if what == "train"]
    assert len(syncs) == 2  # after steps 2 and 4 (the start-up sync ran before the spy was in place)
    for s0, s1 in syncs:  # a weight update never overlaps a generation
        assert all(s1 <= g0 or g1 <= s0 for g0, g1 in gens), (s0, s1)
    # and the overlap is real: some optimizer step ran while a rollout was generating, on the main thread
    assert any(g0 < t1 and t0 < g1 for t0, t1 in trains for g0, g1 in gens)
    assert {thread for what, *_, thread in log if what == "generate"} - {"MainThread"}


def test_async_flags_are_checked():
    from slime_sparse.config import RunConfig

    def refused(sections, match):
        with pytest.raises(ValueError, match=match):
            RunConfig.from_dict(sections)

    ok = {"reward": {"num_workers": 1}}
    refused({"overlap": {"async_train": True, "update_weights_interval": 2, "max_staleness": 1}, **ok},
            "--max-staleness=1 is below --update-weights-interval=2")
    refused({"overlap": {"update_weights_interval": 2}}, "--update-weights-interval=2 needs --async")
    refused({"overlap": {"async_train": True}, "reward": {"num_workers": 0}}, "--async with --rm-num-workers 0")
    refused({"overlap": {"async_train": True}, "cluster": {"colocate": True}, **ok}, "--async with --colocate")
    refused({"overlap": {"async_train": True}, "rollout": {"dynamic_sampling_filter_path": [
        "check_min_kept_samples"]}, **ok}, "cannot see what the correction rejects")
    refused({"overlap": {"partial_rollout": True}}, "needs --over-sampling-batch-size > --rollout-batch-size")
    refused({"overlap": {"partial_rollout": True}, "rollout": {"engine": "sglang", "over_sampling_batch_size": 200}},
            "--partial-rollout needs --rollout-engine embedded")
    refused({"overlap": {"mask_offpolicy_in_partial_rollout": True}}, "has no effect without --partial-rollout")
    assert RunConfig.from_dict({"overlap": {"async_train": True}, **ok}).rollout_plan(0).defer_old


PARTIAL = ["--partial-rollout", "--over-sampling-batch-size", "4", "--rollout-max-response-len", "48",
           "--rollout-stop-token-ids", "3"]


def test_partial_rollouts_in_the_async_loop(assets, tmp_path):
    """Groups the batch did not need are carried on; continued samples say which versions wrote them; the bound
    holds; --mask-offpolicy-in-partial-rollout leaves their older tokens out of the loss."""
    from slime_sparse.train import main

    run = tmp_path / "run"
    # --max-staleness 2: under --async every sample is already one version old, so a bound of 1 regenerates every
    # carried group whose tokens came from an earlier rollout, and none is ever continued by newer weights
    assert main(run_args(assets, run, 4, *ASYNC, *PARTIAL, "--max-staleness", "2",
                         "--mask-offpolicy-in-partial-rollout")) == 0
    rows = rollout_rows(run)
    assert sum(r["rollout/partial_continued"] for r in rows) > 0 and sum(r["rollout/partial_aborted"] for r in rows)
    ledger = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert max(r["staleness"] for r in ledger) <= 2
    continued = [r for r in ledger if len(r["segments"]) > 1]
    assert continued, "no trained sample was continued across rollouts"
    assert any(r.get("rollout/offpolicy_masked_frac", 0) > 0 for r in rows)
    keys = [(r["prompt_index"], r["sample"] % 4) for r in ledger]
    assert len(set(r["prompt_index"] for r in ledger)) * 4 == len(ledger)  # whole groups, each prompt once
    state = json.loads((run / "checkpoints" / "rollout_000004" / "trainer_state.json").read_text())
    left = {g["index"] for g in state["data_state"]["partial"]}
    assert not left & {p for p, _ in keys}  # what is still carried was not trained


def fault_run(argv, env_fault: str | None, log: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SLIME_SPARSE_FAULT", None)
    if env_fault:
        env.update(SLIME_SPARSE_FAULT=env_fault, SLIME_SPARSE_FAULT_RECORD=str(log.parent / "faults"))
    with open(log, "w") as fh:
        return subprocess.run([sys.executable, "-m", "slime_sparse.train", *argv], cwd=ROOT, env=env, stdout=fh,
                              stderr=subprocess.STDOUT, timeout=900).returncode


def trained(run: Path) -> list[tuple[int, int]]:
    return [(r["step"], r["prompt_index"]) for r in map(json.loads, (run / "samples.jsonl").read_text().splitlines())]


@pytest.mark.slow
@pytest.mark.parametrize("extra, fault", [
    ([], "learner.backward@5"),  # mid-training of rollout 2, rollout 3 generating beside it
    (PARTIAL, "engine.step@100"),  # mid-generation (the 2nd or 3rd rollout), groups carried between rollouts
], ids=["async", "async-partial"])
def test_a_kill_mid_async_keeps_every_sample_once(assets, tmp_path, extra, fault):
    """SIGKILL mid-async, rerun the command: metrics.jsonl holds every rollout once, samples.jsonl every trained
    sample once, no prompt is trained twice; without partial rollouts each step trains the prompts of the
    uninterrupted run (the data position restored), with them every prompt trained is one the stream handed out."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert fault_run(run_args(assets, ref, 4, *ASYNC, *extra), None, tmp_path / "ref.log") == 0
    argv = run_args(assets, run, 4, *ASYNC, *extra)
    rc = fault_run(argv, fault, tmp_path / "killed.log")
    assert rc == -9, (tmp_path / "killed.log").read_text()[-2000:]
    assert fault_run(argv, None, tmp_path / "resumed.log") == 0
    assert "resumed from" in (tmp_path / "resumed.log").read_text()
    assert [r["step"] for r in rollout_rows(run)] == [1, 2, 3, 4]
    got, want = trained(run), trained(ref)
    prompts = [p for _, p in got][::4]
    assert len(prompts) == len(set(prompts)), "a prompt was trained twice"
    assert all(got.count(x) == 4 for x in set(got))  # whole groups
    if not extra:
        assert got == want


RAY_1X2 = ["--use-ray", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2", "--ray-cpus-per-actor", "0.2",
           "--ray-timeout", "120", "--update-weight-buffer-size", "16384"]


@pytest.mark.ray
@pytest.mark.parametrize("extra", [[], PARTIAL], ids=["async", "async-partial"])
def test_async_on_ray_two_engines_one_learner(local_ray, assets, tmp_path, extra):
    """The same loop over Ray actors (1 learner rank, 2 engines; the rollout thread waits on the engine actors while
    the driver drives the learner): the staleness schedule holds, partial groups split at group boundaries."""
    from slime_sparse.train import main

    run = tmp_path / "run"
    assert main(run_args(assets, run, 3, *ASYNC, *RAY_1X2, *extra)) == 0
    rows = rollout_rows(run)
    # interval 1: one version old after the first; a continued sample is as old as its first stretch (no bound set)
    if not extra:
        assert [(r["rollout/staleness_min"], r["rollout/staleness_max"]) for r in rows] == [(0, 0), (1, 1), (1, 1)]
    else:
        assert rows[0]["rollout/staleness_max"] == 0 and all(1 <= r["rollout/staleness_min"] for r in rows[1:])
        assert all(r["rollout/staleness_max"] <= i for i, r in enumerate(rows))
    ledger = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    prompts = [r["prompt_index"] for r in ledger][::4]
    assert len(prompts) == len(set(prompts)) == 6
    if extra:
        assert sum(r["rollout/partial_aborted"] for r in rows) > 0


@pytest.mark.ray
def test_async_on_sglang_engines(local_ray, assets, tmp_path):
    """The SGLang path (--rollout-engine sglang on Ray, two attached fake servers): the rollout thread drives the
    servers while the learner trains; each update reaches both servers after the generation in flight drained, and
    the last one leaves them holding the final checkpoint's weights."""
    from safetensors.torch import load_file

    from slime_sparse.train import main
    from tests.ray.test_sglang import fake_server_processes, fetch_state, flags

    run = tmp_path / "run"
    with fake_server_processes(2) as urls:
        assert main([*flags(assets, urls), "--run-dir", str(run), "--save-interval", "1", "--rollout-batch-size", "2",
                     "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--rollout-max-response-len", "6",
                     "--num-rollout", "3", "--custom-rm-path", "slime_sparse.tasks.repeated_add:task_reward",
                     "--no-use-tensorboard", "--no-progress-bar", "--ray-timeout", "300", *ASYNC]) == 0
        rows = rollout_rows(run)
        assert [(r["rollout/staleness_min"], r["rollout/staleness_max"]) for r in rows] == [(0, 0), (1, 1), (1, 1)]
        final = load_file(str(run / "checkpoints" / "rollout_000003" / "model" / "model.safetensors"))
        final.setdefault("lm_head.weight", final["model.embed_tokens.weight"])
        for url in urls:
            state = fetch_state(url)
            assert all(torch.equal(state.weights[n], final[n]) for n in state.weights), url


def test_train_async_entry_point_is_train_with_async(monkeypatch):
    """`python -m slime_sparse.train_async ARGS` (slime's entry point) is slime-sparse-train --async ARGS."""
    import slime_sparse.train as train_mod
    from slime_sparse.train_async import main as async_main

    seen = []
    monkeypatch.setattr(train_mod, "main", lambda argv: seen.append(argv) or 0)
    assert async_main(["--num-rollout", "3"]) == 0 and seen == [["--async", "--num-rollout", "3"]]


def test_overlap_arithmetic():
    """benchmarks/async_overlap.py's step model: sync = every phase in turn; async = the engines' side (rollout +
    reward) beside the learner's (recompute + correction + learner step + other), then the weight update alone."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("async_overlap", ROOT / "benchmarks" / "async_overlap.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.overlap_row("m", {"rollout": 3.0, "reward": 1.0, "recompute": 1.0, "correction": 0.5,
                                  "learner step": 2.0, "other": 0.5, "weight update": 0.25, "step": 99.0})
    assert row == "| m | 4.000 | 4.000 | 0.250 | 8.250 | 4.250 | 1.94x |"
    assert bench.overlap_row("m", {"rollout": 6.0, "learner step": 1.0}).endswith("| 7.000 | 6.000 | 1.17x |")
