"""The tiny recipe through the same train.py loop on a local Ray cluster (2 learner ranks, 2 engines).

Reference: the embedded (single-process) run of the same command. Rollouts are seeded per sample and
the data-parallel update equals the single-process one, so the first rollout is identical and the
first update agrees to float tolerance.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from slime_sparse.train import main  # noqa: E402
from tests.helpers.tiny_runs import rollout_rows, run_args  # noqa: E402


def args(assets, run_dir, num_rollout, *extra):
    """The shared tiny command, evaluated on 2 prompts."""
    return run_args(assets, run_dir, num_rollout, "--eval-prompt-data", str(assets.test_path),
                    "--eval-max-prompts", "2", *extra)

pytestmark = pytest.mark.ray

RAY_FLAGS = ["--use-ray", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--ray-cpus-per-actor", "0.2",
             "--ray-timeout", "120", "--update-weight-buffer-size", "16384"]


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(n_train=64)


def final_weights(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"rollout_{step:06d}" / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def local_run(assets, tmp_path_factory):
    """The embedded (single-process) run of the same command: the reference of every layout."""
    local = tmp_path_factory.mktemp("local") / "run"
    assert main(args(assets, local, 2)) == 0
    return local


@pytest.mark.parametrize("layout", [
    pytest.param([], id="disaggregated"),
    # learner ranks and engines share bundles; weights handed over through the object store
    pytest.param(["--colocate"], id="colocated"),
])
def test_tiny_recipe_on_ray_matches_the_embedded_run(local_ray, assets, local_run, tmp_path, layout):
    local, on_ray = local_run, tmp_path / "ray"
    assert main(args(assets, on_ray, 2, *RAY_FLAGS, *layout)) == 0

    a, b = rollout_rows(local), rollout_rows(on_ray)
    assert [r["step"] for r in b] == [1, 2]
    for key in ("rollout/reward_mean", "rollout/response_len_mean", "kv/savings"):
        assert b[0][key] == a[0][key], key  # same weights, same per-sample seeds: the same rollout
    for key in ("train/loss", "train/grad_norm", "mismatch/k3", "correction/xi_mean"):
        assert b[0][key] == pytest.approx(a[0][key], rel=1e-4, abs=1e-6), key
    for row in b:
        assert all(v is None or not isinstance(v, float) or math.isfinite(v) for v in row.values())
    # every rollout ends with a sync, which the engines acknowledge with a newer version
    assert b[1]["rollout/weight_version"] == b[0]["rollout/weight_version"] + 1 >= 3
    summary = json.loads((on_ray / "summary.json").read_text())
    assert set(summary["evals"]) == {"0", "2"} and "dense" in summary["evals"]["2"]
    wa, wb = final_weights(local, 1), final_weights(on_ray, 1)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_ray_run_resumes_from_its_last_checkpoint(local_ray, assets, tmp_path):
    """A run stopped after rollout 2 (e.g. a learner failure) resumes from its checkpoint with the same command."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(args(assets, straight, 3, *RAY_FLAGS)) == 0
    assert main(args(assets, resumed, 2, *RAY_FLAGS)) == 0
    assert main(args(assets, resumed, 3, *RAY_FLAGS)) == 0
    assert [r["step"] for r in rollout_rows(resumed)] == [1, 2, 3]
    state_a = json.loads((straight / "checkpoints" / "rollout_000003" / "trainer_state.json").read_text())
    state_b = json.loads((resumed / "checkpoints" / "rollout_000003" / "trainer_state.json").read_text())
    assert state_a["data_state"] == state_b["data_state"]
    rewards = [[r["rollout/reward_mean"] for r in rollout_rows(run)] for run in (straight, resumed)]
    assert rewards[0] == rewards[1]
    wa, wb = final_weights(straight, 3), final_weights(resumed, 3)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_dynamic_sampling_on_ray_keeps_the_embedded_runs_groups(local_ray, assets, tmp_path):
    """Over-sampling rounds of varying size go through the Ray rollout group like any rollout: the same groups are
    generated, dropped, put back and kept as in the single-process run."""
    ds = ["--over-sampling-batch-size", "4", "--dynamic-sampling-filter-path", "tests.helpers.tiny_runs:keep_even_positions"]
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    assert main(run_args(assets, local, 2, *ds)) == 0
    assert main(run_args(assets, on_ray, 2, *ds, *RAY_FLAGS)) == 0
    keys = ("rollout/groups_generated", "rollout/groups_kept", "rollout/groups_dropped", "rollout/groups_put_back",
            "rollout/reward_mean", "rollout/gen_tokens")
    assert [[r[k] for k in keys] for r in rollout_rows(on_ray)] == [[r[k] for k in keys] for r in rollout_rows(local)]
