#!/usr/bin/env bash
# Run slime_sparse training on a multi-node Ray cluster. Every node needs the same Python environment
# (`pip install -e ".[ray]"` from a checkout on a shared file system is simplest) and must see the model,
# the data and the run directory at the same paths (a shared file system).
#
#   bash examples/multinode/multinode.sh head                    # on the head node (starts Ray)
#   bash examples/multinode/multinode.sh worker HEAD_IP          # on every other node (joins it)
#   bash examples/multinode/multinode.sh submit HEAD_IP FLAGS... # from any machine: one training job
#   bash examples/multinode/multinode.sh status HEAD_IP          # nodes and free resources
#
# FLAGS are slime-sparse-train flags; --use-ray is added. Example for 2 nodes x 8 GPUs, 8 learner ranks
# on node 1 and 8 single-GPU engines on node 2:
#   bash examples/multinode/multinode.sh submit 10.0.0.1 --hf-checkpoint /shared/Qwen2.5-3B \
#     --prompt-data /shared/train.jsonl --run-dir /shared/runs/qwen3b \
#     --actor-num-nodes 1 --actor-num-gpus-per-node 8 --rollout-num-gpus 8 --bf16
#
# Ray >= 2.5x starts clusters with token authentication: `head` writes ~/.ray/auth_token; give worker
# nodes and the submitting machine the same file (or export RAY_AUTH_TOKEN) and keep RAY_AUTH_MODE=token.
set -euo pipefail

GCS_PORT=${GCS_PORT:-6379}
DASHBOARD_PORT=${DASHBOARD_PORT:-8265}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}

usage() { sed -n '2,20p' "$0"; exit 2; }
[[ $# -ge 1 ]] || usage
cmd=$1; shift
case "$cmd" in
  head)
    ray start --head --port="$GCS_PORT" --dashboard-host=0.0.0.0 --dashboard-port="$DASHBOARD_PORT" "$@"
    ;;
  worker)
    [[ $# -ge 1 ]] || usage
    head=$1; shift
    ray start --address="$head:$GCS_PORT" "$@"
    ;;
  submit)
    [[ $# -ge 1 ]] || usage
    head=$1; shift
    # The job's driver runs on the head node and finds the cluster through RAY_ADDRESS (set by Ray).
    # Add `--working-dir .` after `submit` if slime_sparse is not installed on the nodes.
    ray job submit --address="http://$head:$DASHBOARD_PORT" -- slime-sparse-train --use-ray "$@"
    ;;
  status)
    [[ $# -ge 1 ]] || usage
    ray status --address="$1:$GCS_PORT"
    ;;
  *) usage ;;
esac
