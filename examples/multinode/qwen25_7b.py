#!/usr/bin/env python
"""Sparse-RL on Qwen2.5-7B, 2 nodes x 8 GPUs: the authors' published settings on our stack.

    python examples/multinode/qwen25_7b.py --head 10.0.0.1 --model /shared/Qwen2.5-7B \\
        --data /shared/dapo_math.jsonl --eval-data /shared/math500.jsonl --run-dir /shared/runs/q7b_sparse_rl
    python examples/multinode/qwen25_7b.py ... --dry-run        # print the command, submit nothing

Node 1: 8 Megatron learner ranks (TP 2 x DP 4, bf16, distributed optimizer) training from the HF directory
directly. Node 2: 8 rollout engines, one patched SGLang server each (R-KV, budget 512 + buffer 128, window 8),
fed by NCCL broadcast from learner rank 0. Recipe (docs/algorithm.md, the authors' code): GRPO with std
normalisation, eps 0.2, KL k3 1e-4, `mis` correction (truncate 1.5, mask [0.5, 1.5], veto 1e-4, batch
normalisation), Adam 1e-6 / wd 0.1 / betas (0.9, 0.98), 128 prompts x 8 samples, global batch 256 (4 optimizer
steps per rollout), responses up to 4096 tokens at temperature 1, 100 rollouts. The data are jsonl rows with a
`prompt` (chat messages or text) and a `label` (the reference answer), graded by `--rm-type math`.

Size it first: `python tools/plan_memory.py --hf-config /shared/Qwen2.5-7B --prompt-len 512 --max-new-tokens 4096
--learner-layouts 2x1x4 --use-kl-loss` (39 GiB of learner state per GPU, activations aside; a request peaks at
640 KV slots instead of 4607, so an 80 GiB server holds 6.9x as many at once). Not run by us: no GPU cluster
was available; `tests/e2e/test_examples.py` checks that the command parses and fits the layout rules.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

LAYOUT = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8",  # learner: node 1
    "--train-backend", "megatron", "--tensor-model-parallel-size", "2", "--bf16",
    "--rollout-engine", "sglang", "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "1",  # node 2
    "--update-weight-mode", "broadcast", "--sglang-mem-fraction-static", "0.8",
]
RECIPE = [
    "--rollout-batch-size", "128", "--n-samples-per-prompt", "8", "--global-batch-size", "256",
    "--rollout-max-response-len", "4096", "--rollout-temperature", "1.0",
    "--kv-method", "rkv", "--kv-budget", "512", "--kv-buffer", "128", "--kv-window", "8", "--kv-granularity", "model",
    "--correction-preset", "mis",
    "--eps-clip", "0.2", "--use-kl-loss", "--kl-loss-coef", "1e-4", "--kl-loss-type", "k3",
    "--lr", "1e-6", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    "--num-rollout", "100", "--save-interval", "10", "--eval-interval", "10", "--keep-last", "3",
    "--rm-type", "math", "--apply-chat-template", "--input-key", "prompt", "--label-key", "label",
    "--n-samples-per-eval-prompt", "4",
]


def train_flags(model: str, data: str, eval_data: str, run_dir: str) -> list[str]:
    """slime-sparse-train flags of the run (without --use-ray, which multinode.sh adds)."""
    return ["--hf-checkpoint", model, "--prompt-data", data, "--eval-prompt-data", eval_data, "--run-dir", run_dir,
            *LAYOUT, *RECIPE]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", required=True, help="IP of the Ray head node (bash multinode.sh head)")
    parser.add_argument("--model", required=True, help="HF Qwen2.5-7B directory on the shared file system")
    parser.add_argument("--data", required=True, help="training prompts (jsonl / parquet)")
    parser.add_argument("--eval-data", required=True, help="evaluation prompts (jsonl / parquet)")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of submitting it")
    args, extra = parser.parse_known_args(argv)  # anything else goes to slime-sparse-train (last wins)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multinode.sh")
    cmd = ["bash", script, "submit", args.head,
           *train_flags(args.model, args.data, args.eval_data, args.run_dir), *extra]
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
