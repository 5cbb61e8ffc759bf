#!/usr/bin/env bash
# Everything in this project that only a GPU can show, in one command, for the first GPU session.
# Each step's output goes to OUT/<step>.log; a summary of exit codes is printed at the end. A step that fails does
# not stop the others. Needs a CUDA torch; the SGLang step also needs `pip install "sglang==$(python -c
# 'from sglang_patches.version import SGLANG_VERSION as v; print(v)')"` (it pulls its own CUDA torch, so use a
# separate environment if torch must stay as it is) and `pip install -e .` for the plugin's entry point.
#
#   bash tools/gpu_checks.sh [OUT]            # default OUT=outputs/gpu_checks
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_checks}
mkdir -p "$OUT"
declare -A RC

step() {  # step NAME CMD...: run, log, remember the exit code
  local name=$1; shift
  echo "=== $name: $*" | tee "$OUT/$name.log"
  "$@" >>"$OUT/$name.log" 2>&1
  RC[$name]=$?
  tail -n 15 "$OUT/$name.log"
}

GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
step env bash -c "nvidia-smi; python -c 'import torch; print(torch.__version__, torch.version.cuda)'"
# the CUDA-only tests (checkpoint RNG of CUDA generators), and the whole suite on a GPU machine
step tests_cuda python -m pytest -q -p no:cacheprovider -m "" tests/test_checkpoint.py
# embedded engine on CUDA: the rollout benchmark (dense vs budgeted, against HF generate) in bf16
# (#16's GPU rows: batch 64, 256..4k new tokens, R-KV budget 512; dense KV of smollm2-135m at 4k is ~6 GiB)
step rollout_bench python benchmarks/rollout_bench.py --device cuda --dtype bfloat16 --max-kv-gib 40 --repeats 2 \
  --budgets 512 --rows qwen2-19m:64:128:256 qwen2-19m:64:128:1024 qwen2-19m:64:128:4096 qwen2-19m:64:128:1024:8 \
  smollm2-135m:64:128:1024 smollm2-135m:64:128:4096
# Megatron learner: DDP + distributed optimizer + schedules (+ TE when installed), TP / PP with 2 GPUs
LAYOUTS="1x1"; [ "$GPUS" -ge 2 ] && LAYOUTS="1x1 2x1 1x2"
# shellcheck disable=SC2086
step megatron_smoke python examples/megatron/smoke_train.py --layouts $LAYOUTS --bf16 --steps 5
# SGLang plugin inside live servers: parity with the unpatched server, no leak, CUDA graphs, weight update
if python -c "import sglang" 2>/dev/null; then
  step sglang_contract python -m sglang_patches.contract
  step sglang_smoke python examples/sglang/smoke.py --out "$OUT/sglang_smoke"
else
  echo "=== sglang: not installed, skipped (see the header of this script)" | tee "$OUT/sglang.log"
  RC[sglang]="skipped"
fi

echo; echo "summary (exit codes; logs in $OUT):"
for name in "${!RC[@]}"; do printf '  %-16s %s\n' "$name" "${RC[$name]}"; done | sort
