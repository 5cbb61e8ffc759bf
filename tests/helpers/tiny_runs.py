"""The tiny training command the end-to-end tests share, and readers of what a run writes."""
from __future__ import annotations

import json


def run_args(assets, run_dir, num_rollout: int, *extra: str) -> list[str]:
    """slime_sparse.train flags: the tiny task, R-KV rollouts with the `mis` correction and the KL loss,
    2 prompts x 4 samples a rollout, a checkpoint after every rollout; `extra` flags come last (they win)."""
    return [
        "--hf-checkpoint", str(assets.model_dir), "--prompt-data", str(assets.train_path),
        "--custom-rm-path", "slime_sparse.tasks.repeated_add:task_reward", "--rm-num-workers", "0",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--global-batch-size", "4",
        "--rollout-max-response-len", "24", "--kv-method", "rkv", "--kv-budget", "16", "--kv-buffer", "4",
        "--kv-window", "4", "--correction-preset", "mis", "--use-kl-loss", "--kl-loss-coef", "1e-3",
        "--lr", "1e-3", "--num-rollout", str(num_rollout), "--run-dir", str(run_dir), "--save-interval", "1",
        "--no-use-tensorboard", "--no-progress-bar", *extra,
    ]


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rollout_rows(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "rollout/reward_mean" in r]


def keep_even_positions(cfg, samples):
    """A dynamic-sampling filter with a known outcome: keep the groups of even stream positions."""
    from slime_sparse.rollout.filter_hub import DynamicFilterOutput

    keep = samples[0].prompt_index % 2 == 0
    return DynamicFilterOutput(keep=keep, reason=None if keep else "odd")


def keep_every_third(cfg, samples):
    """Keep positions 0, 3, 6, ... (a bare bool, slime's older filter form)."""
    return samples[0].prompt_index % 3 == 0


def comparable(row: dict) -> dict:
    """A metrics line without what differs between two runs of the same seed: wall-clock times, and the weight
    version (a resumed run counts one more sync, at its start)."""
    return {k: v for k, v in row.items() if not k.startswith("perf/") and not k.endswith("/seconds")
            and k not in ("time", "rollout/weight_version")}


# ---- rollout functions with slime's signature, for --rollout-function-path

def first_group_only(args, rollout_id, data_source, evaluation=False):
    """The default rollout cut to its first group, with a metric of its own."""
    from slime_sparse.rollout.base_types import RolloutFnTrainOutput
    from slime_sparse.rollout.sparse_rollout import generate_rollout

    out = generate_rollout(args, rollout_id, data_source, evaluation=evaluation)
    return RolloutFnTrainOutput(samples=out.samples[:1], metrics={"custom/rollout_id": float(rollout_id)})


def groups_only(args, rollout_id, data_source, evaluation=False):
    """slime's older form: the bare list of groups (no metrics, no pi_old: the loop computes what it needs)."""
    from slime_sparse.rollout.sparse_rollout import generate_rollout

    return generate_rollout(args, rollout_id, data_source, evaluation=evaluation).samples


# ---- a stop at a known point: a filter that signals its own process at one stream position

STOP_AT: dict = {"prompt_index": None, "signal": None}


def signal_at(cfg, samples):
    """Keep every group; send STOP_AT["signal"] to this process when the group of STOP_AT["prompt_index"] is
    judged (during that rollout's generation), once."""
    import os

    if samples[0].prompt_index == STOP_AT["prompt_index"]:
        STOP_AT["prompt_index"] = None
        os.kill(os.getpid(), STOP_AT["signal"])
    return True
