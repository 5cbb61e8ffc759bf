#!/usr/bin/env bash
# The tiny recipe on Ray, on this machine: 2 data-parallel learner ranks + 2 rollout engines as Ray actors,
# driven by the same training loop as the embedded run. CPU only; needs `pip install -e ".[ray]"`.
#
#   bash examples/multinode/run_tiny_ray.sh                 # a local Ray instance is started and stopped
#   RAY_ADDRESS=auto bash examples/multinode/run_tiny_ray.sh   # or join the cluster `ray start` runs here
#
# Environment: RUN_DIR (default runs/tiny_ray), ASSETS (default .cache/tiny_assets), NUM_ROLLOUT (default 4).
# Extra arguments go to slime-sparse-train, e.g. `--colocate` or `--update-weight-mode tensor`.
# Rerunning the same command after a failure resumes from the last checkpoint in $RUN_DIR/checkpoints.
set -euo pipefail

RUN_DIR=${RUN_DIR:-runs/tiny_ray}
ASSETS=${ASSETS:-.cache/tiny_assets}
NUM_ROLLOUT=${NUM_ROLLOUT:-4}

# Tiny running-sum data and a ~20k-parameter Qwen2 (random init, no warm start): built once, then cached.
ASSET_DIR=$(python - "$ASSETS" <<'PY'
import sys
from slime_sparse.tasks.assets import AssetsConfig, build_assets
from slime_sparse.tasks.repeated_add import RepeatedAddConfig
from slime_sparse.tasks.tiny_model import TinyModelConfig

cfg = AssetsConfig(task=RepeatedAddConfig(min_count=2, max_count=4),
                   model=TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                         intermediate_size=64, max_position_embeddings=128),
                   warm_start=None, n_train=256, n_test=16)
print(build_assets(sys.argv[1], cfg, log=lambda msg: print(msg, file=sys.stderr)).root)
PY
)

# Cluster layout (slime's flags): --actor-num-nodes x --actor-num-gpus-per-node learner ranks, --rollout-num-gpus
# engine slots; without GPUs each is a bundle of --ray-cpus-per-actor CPUs.
slime-sparse-train \
  --hf-checkpoint "$ASSET_DIR/model" --prompt-data "$ASSET_DIR/train.jsonl" \
  --eval-prompt-data "$ASSET_DIR/test.jsonl" --eval-max-prompts 8 \
  --custom-rm-path slime_sparse.tasks.repeated_add:task_reward --rm-num-workers 0 \
  --rollout-batch-size 4 --n-samples-per-prompt 4 --global-batch-size 8 --rollout-max-response-len 48 \
  --kv-method rkv --kv-budget 24 --kv-buffer 8 --kv-window 4 --correction-preset mis \
  --lr 1e-3 --num-rollout "$NUM_ROLLOUT" --save-interval 1 --run-dir "$RUN_DIR" --no-use-tensorboard \
  --use-ray --actor-num-nodes 1 --actor-num-gpus-per-node 2 --rollout-num-gpus 2 --ray-cpus-per-actor 0.5 \
  --ray-timeout 300 \
  "$@"
