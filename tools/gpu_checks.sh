#!/usr/bin/env bash
# Everything in this project that only a GPU can show, in one command: <= 8 minutes on one GPU, one table at the end.
#
# It runs unchanged on the device machine's image (Python 3.12, torch 2.11 + CUDA 13, transformers 5.17, Triton; no
# package registry, no Apex, Transformer Engine, SGLang or Ray): the project from the checkout (PYTHONPATH), the wheels
# the image lacks (tools/gpu_wheels.txt: megatron-core, datasets, ...) carried in the git-ignored .whl/, and the tiny
# recipe's assets in .cache/tiny_assets (both made once, on a machine with the registry: `bash
# tools/fetch_gpu_wheels.sh`). The device tool's call, from a checkout holding this script, .whl/ and the assets:
#
#   run(carry=[".whl", ".cache/tiny_assets"], timeout_s=560, command=
#     "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site
#      .whl/*.whl && export PYTHONPATH=/tmp/site && bash tools/gpu_checks.sh $OUT")
#
# (one line). What comes back from $OUT (at most 8 files): summary.txt, steps.tsv, gpu_report.jsonl, rl_step.jsonl and
# logs.tar.gz (every step's log; unpacked there while the script runs). On a GPU node with a registry:
# `pip install -e ".[megatron]"`, then `bash tools/gpu_checks.sh [OUT]` (default outputs/gpu_checks).
#
# Every step runs under its own timeout (seconds, the second argument of `step`), logs to <step>.log and records
# its exit code and wall time in OUT/steps.tsv (a skipped step: why, in a fifth column); a failed or timed-out step
# (exit 124) does not stop the others. The timeouts add up to 480 s; the figures of every step end up in one table
# (tools/gpu_summary.py, OUT/summary.txt). Training runs write their run directories under a temporary directory.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_checks}
mkdir -p "$OUT"
: >"$OUT/steps.tsv"
: >"$OUT/gpu_report.jsonl"
RUNS=$(mktemp -d)  # run directories of the training steps (checkpoints: not worth bringing back)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

step() {  # step NAME TIMEOUT_S CMD...: run under a timeout, log, record exit code and seconds
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "=== $name (timeout ${limit}s): $*" | tee "$OUT/$name.log"
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >>"$OUT/steps.tsv"
  tail -n 8 "$OUT/$name.log"
}

# 1. the machine and what imports on it
step env 15 bash -c 'nvidia-smi -L; python3 - <<EOF
import importlib.util, platform, torch, transformers
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-"
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__, "gpu", gpu)
for name in ("megatron.core", "datasets", "triton", "transformer_engine", "apex", "scaled_masked_softmax_cuda",
             "sglang", "ray"):
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        found = False
    print("import", name, "yes" if found else "no")
EOF'

# 2. the tests marked gpu: exactness on CUDA (fp32 and bf16, both LM-head settings; figures to gpu_report.jsonl), the
#    CUDA-graph decode step; CUDA RNG checkpoints; the Megatron kernel probe on a real GPU
SLIME_SPARSE_GPU_REPORT="$OUT/gpu_report.jsonl" step gpu_tests 85 python3 -m pytest -q -p no:cacheprovider -m "" -rs \
  tests/test_gpu_exactness.py tests/test_gpu_engine.py tests/test_megatron_kernels.py \
  tests/test_checkpoint.py::test_cuda_rng_and_optimizer_state_round_trip

# 3. ---- rollout benchmark: the embedded engine on CUDA (CUDA graphs, bf16), the targets of #33 in print order: the
#    same KV memory (8 GiB, 128 + 4096 tokens: tok/s of dense vs R-KV 512 + 128, each decoding one wave of as many
#    sequences as fit, at most 256), then batch 64 at 128 new tokens (warm HF, dense, R-KV at a tight 64 + 32): ~170 s
#    on an H200 (2026-11-27). Rows print as they finish, so a timeout still leaves the first ones. Batch 256 at 4096
#    tokens, dense vs R-KV, takes over 2 minutes on its own: `benchmarks/rollout_bench.py --suite gpu-extra`.
step rollout_bench 190 python3 benchmarks/rollout_bench.py --device cuda --dtype bfloat16 --max-kv-gib 40 --repeats 3 \
  --long-repeats 1 --long-warmup-new 640 --suite gpu --hf-max-new 128 --same-kv-gib 8 --same-kv-warmup-new 640 \
  --same-kv-max-prompts 256
# ---- end of the rollout benchmark step ----

# 4. Megatron learner: DDP + distributed optimizer + schedules, fusions as probed (layouts 2x1 and 1x2 with 2 GPUs),
#    the output layer as an fp32 GEMM through Megatron's vocab-parallel head (--enable-fp32-lm-head)
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
LAYOUTS="1x1"; [ "$GPUS" -ge 2 ] && LAYOUTS="1x1 2x1 1x2"
# shellcheck disable=SC2086
step megatron_smoke 50 python3 examples/megatron/smoke_train.py --layouts $LAYOUTS --bf16 --steps 5 --enable-fp32-lm-head

# 5. The training loop on CUDA (#34): the tiny recipe for 4 rollouts (its start/end table), with the embedded learner,
#    then with the Megatron learner (Megatron's DDP, optimizer and schedules inside the loop)
TINY=(--num-rollout 4 --eval-interval 4 --save-interval 4)
step train_tiny 35 python3 examples/tiny_cpu/run.py --run-dir "$RUNS/tiny" -- --device cuda "${TINY[@]}"
step train_tiny_megatron 35 python3 examples/tiny_cpu/run.py --run-dir "$RUNS/tiny_megatron" -- --device cuda \
  --train-backend megatron "${TINY[@]}"

# 6. The whole RL step, dense vs Sparse-RL (R-KV 512 + 128) at the same rollout KV memory: Qwen2.5-0.5B's shape,
#    8 x 8 samples x (128 + 1024) tokens, bf16, full recompute, 2 steps per mode (the first a warm-up). The issue's
#    target size (1.5B, 256 x 2048) takes longer: README "On a GPU"
step rl_step_bench 70 python3 benchmarks/rl_step_bench.py --shape 0.5b --prompts 8 --n-samples 8 \
  --response-len 1024 --steps 2 --cache-dir "$RUNS/rl_step_model" --out "$OUT/rl_step.jsonl"

# 7. SGLang plugin inside live servers (parity with the unpatched server, no leak, CUDA graphs, weight update)
if python3 -c "import sglang" 2>/dev/null; then
  step sglang_contract 60 python3 -m sglang_patches.contract
  step sglang_smoke 300 python3 examples/sglang/smoke.py --out "$OUT/sglang_smoke"
else
  echo "=== sglang: skipped. SGLang is not installed, and it cannot be on the device machine's image: it reaches no" \
       "package registry, and SGLang's CUDA wheels (sgl-kernel, flashinfer) are hundreds of MB, far over the 64 MiB" \
       "a device call can carry. Run examples/sglang/smoke.py on a GPU node with SGLang (sglang_patches/README.md)."
  why="not installable here (no registry; its CUDA wheels exceed what a call carries)"
  printf 'sglang\tskipped\t0\t0\t%s\n' "$why" >>"$OUT/steps.tsv"
fi

python3 tools/gpu_summary.py "$OUT" | tee "$OUT/summary.txt"
# the step logs as one file (the device call brings back at most 8)
(cd "$OUT" && tar -czf logs.tar.gz ./*.log && rm -f ./*.log)
rm -rf "$RUNS"
