"""`--train-backend megatron` through the one training loop (slime_sparse.train.main), on CPU.

Reference: the embedded learner on the same command. Rollouts are seeded per sample and the Megatron
learner computes the same loss and gradients as the embedded one, so the first rollout is identical and
every update agrees to float tolerance; a resumed run is bit-identical to an uninterrupted one.

- one process (TP=1, world 1): metrics, checkpoints in the utils.checkpoint layout with an HF-loadable
  model/, exact resume, clear errors for checkpoints it cannot resume from;
- Ray (2 learner ranks at TP=2, and at PP=2; 4 at TP=2 x DP=2; 1 engine): the same recipe end to end, weights synced by broadcast and then
  through the object store, resumed from its collective checkpoint.

The recipe's model is untrained, so its task reward would be 0 everywhere (zero advantages, a zero policy
loss); `digit_share_reward` gives rewards that differ between samples, so the losses compared are not 0.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core")
from tests.helpers.tiny_runs import rollout_rows  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from slime_sparse.backends.megatron.config import MegatronConfig  # noqa: E402
from slime_sparse.tasks.assets import AssetsConfig, build_assets  # noqa: E402
from slime_sparse.tasks.tiny_model import TinyModelConfig  # noqa: E402
from slime_sparse.train import main  # noqa: E402
from slime_sparse.utils.checkpoint import latest_checkpoint, list_checkpoints  # noqa: E402

pytestmark = pytest.mark.megatron

MEGATRON = ["--train-backend", "megatron"]
RAY = ["--use-ray", "--rollout-num-gpus", "1", "--ray-cpus-per-actor", "0.2", "--ray-timeout", "120",
       "--update-weight-buffer-size", "16384"]
# learner ranks, TP, PP (DP = ranks / (TP x PP))
RAY_LAYOUTS = {"tp2": (2, 2, 1), "pp2": (2, 1, 2), "tp2_dp2": (4, 2, 1)}
# metrics that depend on the learner (recompute, loss, update); the rollout's own must be equal
LEARNER_METRICS = ("train/loss", "train/grad_norm", "kl_loss", "ppo_kl", "mismatch/k3", "correction/xi_mean")
ROLLOUT_METRICS = ("rollout/reward_mean", "rollout/response_len_mean", "kv/savings")


def digit_share_reward(response: str, label, **kwargs) -> float:
    """Share of digits in the response: varies between samples of an untrained model."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    cfg = AssetsConfig(model=TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                             intermediate_size=64, max_position_embeddings=128),
                       warm_start=None, n_train=64, n_test=4)  # the default task (only its prompts are used)
    return build_assets(tmp_path_factory.mktemp("assets"), cfg, log=None)


def args(assets, run_dir, num_rollout, *extra):
    # --global-batch-size 8 = all samples of a rollout: rollout r is optimizer step r
    return [
        "--hf-checkpoint", str(assets.model_dir), "--prompt-data", str(assets.train_path),
        "--custom-rm-path", f"{__name__}:digit_share_reward", "--rm-num-workers", "0",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
        "--rollout-max-response-len", "24", "--kv-method", "rkv", "--kv-budget", "16", "--kv-buffer", "4",
        "--kv-window", "4", "--correction-preset", "mis", "--use-kl-loss", "--kl-loss-coef", "1e-3",
        "--lr", "1e-3", "--num-rollout", str(num_rollout), "--run-dir", str(run_dir), "--save-interval", "1",
        "--no-use-tensorboard", "--no-progress-bar", *extra,
    ]


@pytest.fixture(scope="module")
def embedded_run(assets, tmp_path_factory):
    run = tmp_path_factory.mktemp("embedded") / "run"
    assert main(args(assets, run, 3)) == 0
    return run


def checkpoint(run_dir, step):
    return run_dir / "checkpoints" / f"rollout_{step:06d}"


def weights(run_dir, step):
    return load_file(str(checkpoint(run_dir, step) / "model" / "model.safetensors"))


def trainer_state(run_dir, step):
    return json.loads((checkpoint(run_dir, step) / "trainer_state.json").read_text())


def assert_matches_embedded(rows, ref_rows):
    """Same rollouts, learner metrics within float tolerance, every row finite."""
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows]
    for got, want in zip(rows, ref_rows):
        for key in ROLLOUT_METRICS:
            assert got[key] == want[key], (got["step"], key)
        for key in LEARNER_METRICS:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)
        assert all(not isinstance(v, float) or math.isfinite(v) for v in got.values())
    assert ref_rows[0]["train/loss"] != 0.0 and ref_rows[0]["rollout/reward_mean"] > 0.0


def assert_weights_close(got, want):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_megatron_load_rejects_a_training_checkpoint(tmp_path):
    (tmp_path / "trainer_state.json").write_text("{}")
    with pytest.raises(ValueError, match="--hf-checkpoint"):
        MegatronConfig(load=str(tmp_path)).check_inputs()


def test_single_process_run_matches_embedded_and_resumes_exactly(assets, embedded_run, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(args(assets, straight, 3, *MEGATRON)) == 0
    assert main(args(assets, resumed, 2, *MEGATRON)) == 0  # "stopped" after rollout 2
    assert main(args(assets, resumed, 3, *MEGATRON)) == 0  # same command, longer horizon: resumes

    assert_matches_embedded(rollout_rows(straight), rollout_rows(embedded_run))

    # the utils.checkpoint layout: found, listed and pruned (--keep-last 2) like the embedded learner's
    ckpts = str(straight / "checkpoints")
    assert latest_checkpoint(ckpts) == str(checkpoint(straight, 3))
    assert [step for step, _ in list_checkpoints(ckpts)] == [2, 3]
    assert trainer_state(straight, 3)["data_state"] == trainer_state(embedded_run, 3)["data_state"]
    assert trainer_state(straight, 3)["extra"]["megatron_layout"]["world_size"] == 1
    # model/ is an HF model: from_pretrained loads it, and its weights are the embedded run's
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint(straight, 3) / "model"))
    assert_weights_close({k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}, weights(embedded_run, 3))

    # resume: bit-identical to the uninterrupted run (weights, optimizer moments, data position)
    a, b = rollout_rows(straight), rollout_rows(resumed)
    assert [r["step"] for r in b] == [1, 2, 3]
    assert [r["train/loss"] for r in b] == [r["train/loss"] for r in a]
    assert trainer_state(resumed, 3)["data_state"] == trainer_state(straight, 3)["data_state"]
    wa, wb = weights(straight, 3), weights(resumed, 3)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_resume_errors_name_the_problem(assets, embedded_run, tmp_path):
    from slime_sparse.config_loader import load_config
    from slime_sparse.factory import LearnerSpec, build_learner

    learner = build_learner(LearnerSpec.from_run(load_config(args(assets, tmp_path / "run", 1, *MEGATRON))))
    try:
        with pytest.raises(ValueError, match="not written by the Megatron learner"):
            learner.load_checkpoint(str(checkpoint(embedded_run, 3)))
        learner.save_checkpoint(str(tmp_path / "ckpt" / "rollout_000001"), step=1, data_state={})
        other = tmp_path / "ckpt" / "from_two_ranks"
        shutil.copytree(tmp_path / "ckpt" / "rollout_000001", other)
        state = json.loads((other / "trainer_state.json").read_text())
        state["extra"]["megatron_layout"]["world_size"] = 2
        (other / "trainer_state.json").write_text(json.dumps(state))
        with pytest.raises(ValueError, match="same world size"):
            learner.load_checkpoint(str(other))
        with pytest.raises(ValueError, match="JSON"):  # nothing staged, nothing left behind
            learner.save_checkpoint(str(tmp_path / "ckpt" / "rollout_000002"), step=2, data_state={"x": math.nan})
        assert sorted(os.listdir(tmp_path / "ckpt")) == ["from_two_ranks", "latest", "rollout_000001"]
    finally:
        learner.close()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(RAY_LAYOUTS))
def test_ray_layouts_match_embedded_and_resume(local_ray, assets, embedded_run, tmp_path, layout):
    ranks, tp, pp = RAY_LAYOUTS[layout]
    run = tmp_path / "ray"
    ray_args = [*MEGATRON, *RAY, "--actor-num-gpus-per-node", str(ranks), "--tensor-model-parallel-size", str(tp),
                "--pipeline-model-parallel-size", str(pp)]
    assert main(args(assets, run, 2, *ray_args)) == 0  # weights to the engine by broadcast
    # resumed by the same command; weights now handed over through the object store
    assert main(args(assets, run, 3, *ray_args, "--update-weight-mode", "tensor")) == 0

    rows = rollout_rows(run)
    assert_matches_embedded(rows, rollout_rows(embedded_run))  # step 1's loss included
    assert rows[1]["rollout/weight_version"] == rows[0]["rollout/weight_version"] + 1
    # the collective checkpoint: one optimizer and RNG file per rank, committed once by rank 0
    path = checkpoint(run, 3)
    assert latest_checkpoint(str(run / "checkpoints")) == str(path)
    rank_files = [f"rank{r:05d}.pt" for r in range(ranks)]
    assert sorted(os.listdir(path / "optim")) == sorted(os.listdir(path / "rng")) == rank_files
    saved = trainer_state(run, 3)["extra"]["megatron_layout"]
    assert (saved["world_size"], saved["tensor_model_parallel_size"], saved["pipeline_model_parallel_size"]) == (ranks, tp, pp)
    assert trainer_state(run, 3)["data_state"] == trainer_state(embedded_run, 3)["data_state"]
    # a resume without the optimizer moments would move the weights elsewhere (Adam's first steps are ~lr)
    assert_weights_close(weights(run, 3), weights(embedded_run, 3))
