#!/usr/bin/env bash
# Everything in this project that only a GPU can show, in one command: <= 8 minutes on one GPU, one table at the end.
#
#   bash tools/gpu_checks.sh [OUT] [PROFILE]      # OUT default outputs/gpu_checks; PROFILE default all
#
# Profiles (each <= 480 s of step timeouts, one device call each):
#   all            the checks of every issue, #43's targets at the sizes that fit beside them (batch 64 +128 at full
#                  size, the same-memory tables and the RL step at reduced sizes: their targets read "not measured")
#   targets        #43's rollout targets at their own sizes: batch 64 +128 and 256 +4,096 dense vs R-KV 512 + 128, then
#                  24 GiB of total memory at +4,096, a fixed wave and a length mix
#   rl_step_dense  #43's RL step at its size (1.5B shape, 64 x 8, +4,096, 24 GiB), dense; rl_step_sparse: R-KV. Two
#                  calls on one warm machine; `python tools/gpu_summary.py OUT_DENSE OUT_SPARSE` judges the ratio
# GPU_CHECKS_DRY_RUN=1 runs the benchmark steps of a profile on the CPU at tiny shapes (the rest is skipped): the
# plumbing, flags and records, without a GPU (tests/gpu/test_checks.py).
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
# (one line; add the profile after $OUT). What comes back from $OUT (at most 8 files): summary.txt, steps.tsv,
# gpu_report.jsonl, targets.jsonl, rl_step.jsonl and logs.tar.gz (every step's log; unpacked there while the script
# runs). On a GPU node with a registry: `pip install -e ".[megatron]"`, then `bash tools/gpu_checks.sh [OUT] [PROFILE]`.
#
# Every step runs under its own timeout (seconds, the second argument of `step`), logs to <step>.log and records
# its exit code and wall time in OUT/steps.tsv (a skipped step: why, in a fifth column); a failed or timed-out step
# (exit 124) does not stop the others, and the benchmarks write each row as it finishes. The figures of every step end
# up in one table, then #43's targets with met / missed / not measured (tools/gpu_summary.py, OUT/summary.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_checks}
PROFILE=${2:-all}
DRY=${GPU_CHECKS_DRY_RUN:-}
mkdir -p "$OUT"
: >"$OUT/steps.tsv"
: >"$OUT/gpu_report.jsonl"
: >"$OUT/targets.jsonl"
: >"$OUT/rl_step.jsonl"
RUNS=$(mktemp -d)  # run directories of the training steps (checkpoints: not worth bringing back)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
HOOK_BUDGET=60  # seconds of profile all kept for the hooks below (#43's other GPU checks)

step() {  # step NAME TIMEOUT_S CMD...: run under a timeout, log, record exit code and seconds
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "=== $name (timeout ${limit}s): $*" | tee "$OUT/$name.log"
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >>"$OUT/steps.tsv"
  tail -n 8 "$OUT/$name.log"
}

skip() {  # skip NAME WHY
  echo "=== $1: skipped ($2)"
  printf '%s\tskipped\t0\t0\t%s\n' "$1" "$2" >>"$OUT/steps.tsv"
}

# What the benchmarks run on: #43's shapes on the GPU, or tiny ones on the CPU for a dry run.
if [ -n "$DRY" ]; then
  DEV=(--device cpu --dtype fp32)
  M=tiny RL=(--shape tiny) RL_FULL=(--shape tiny) KV=(--budgets 16 --buffer 8)
  SHORT=tiny:4:24:16 LONG=tiny:8:24:40 MEM_ROW=tiny:1:24:40 MEM_ROW_SMALL=tiny:1:24:24 GIB=0.0003 GIB_SMALL=0.0002
  MIX=(--mix-prompts 16 --same-memory-max-prompts 16) MIX_SMALL=(--mix-prompts 8 --same-memory-max-prompts 8)
else
  DEV=(--device cuda --dtype bfloat16)
  M=qwen2.5-1.5b KV=(--budgets 512 --buffer 128)
  SHORT=$M:64:128:128 LONG=$M:256:128:4096 MEM_ROW=$M:1:128:4096 MEM_ROW_SMALL=$M:1:128:1024 GIB=24 GIB_SMALL=4
  MIX=(--mix-prompts 512 --same-memory-max-prompts 512) MIX_SMALL=(--mix-prompts 256 --same-memory-max-prompts 256)
  # the RL step: #43's size, and the reduced one of profile all (Qwen2.5-0.5B's shape, 8 x 8 x +1024, 0.5 GiB: the
  # dense engine fits about half the samples at once, R-KV all)
  RL_FULL=(--shape 1.5b --prompts 64 --n-samples 8 --response-len 4096 --kv-gib 24)
  RL=(--shape 0.5b --prompts 8 --n-samples 8 --response-len 1024 --kv-gib 0.5)
fi
# --max-kv-gib: dense at batch 256 +4,096 holds 29 GiB of KV (the benchmark skips a dense engine above this)
BENCH=(python3 benchmarks/rollout_bench.py "${DEV[@]}" --methods rkv --max-kv-gib 60 --json "$OUT/targets.jsonl")
RL_BENCH=(python3 benchmarks/rl_step_bench.py "${DEV[@]}" --steps 2 --cache-dir "$RUNS/rl_step_model"
          --out "$OUT/rl_step.jsonl")

env_step() {  # the machine and what imports on it
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
}

profile_all() {
  env_step
  # the tests marked gpu: exactness on CUDA (fp32 and bf16, both LM-head settings; figures to gpu_report.jsonl), the
  # CUDA-graph decode step, the offloaded engine keeping its graphs (#43); CUDA RNG checkpoints; Megatron's kernels;
  # the engine's host row table and device rows agreeing under graphs (#46)
  if [ -n "$DRY" ]; then skip gpu_tests "dry run"; else
  SLIME_SPARSE_GPU_REPORT="$OUT/gpu_report.jsonl" step gpu_tests 100 python3 -m pytest -q -p no:cacheprovider -m "" \
    -rs tests/gpu/test_exactness.py tests/gpu/test_engine.py tests/gpu/test_offload.py \
    tests/backends/megatron/test_kernels.py tests/utils/test_checkpoint.py::test_cuda_rng_and_optimizer_state_round_trip \
    tests/rollout/embedded/test_engine_rows.py::test_rows_agree_under_cuda_graphs
  fi

  # ---- hooks: #43's other GPU checks, HOOK_BUDGET seconds kept for them. One `step NAME SECONDS CMD` line each; a
  #      figure a target reads goes to $OUT/targets.jsonl as a JSON record (tools/gpu_targets.py names the shapes:
  #      {"table": "compaction_scratch", "model": "qwen2.5-1.5b", "batch": 256, "scratch_gib": ...}).
  #   the fused R-KV kernel: exactness and time against the PyTorch path, the compaction's scratch at batch 256
  #   the decode step's variants: compiled or not, the attention variants
  # ---- end of hooks ----

  # the rollout benchmark on CUDA (graphs, bf16): batch 64 at 128 new tokens (warm HF, dense, R-KV at a tight
  # 64 + 32: #43's first target at its size), then the same-memory tables at a reduced size (4 GiB, +1,024)
  step rollout_bench 110 "${BENCH[@]}" --rows "$SHORT@64+32" --hf-max-new 128 --repeats 3 --same-memory-gib "$GIB_SMALL" \
    --same-memory-rows "$MEM_ROW_SMALL" "${MIX_SMALL[@]}" "${KV[@]}"

  # Megatron learner: DDP + distributed optimizer + schedules, fusions as probed (layouts 2x1 and 1x2 with 2 GPUs),
  # the output layer as an fp32 GEMM through Megatron's vocab-parallel head (--enable-fp32-lm-head)
  if [ -n "$DRY" ]; then skip megatron_smoke "dry run"; skip train_tiny "dry run"; skip train_tiny_megatron "dry run"
  else
  GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  LAYOUTS="1x1"; [ "$GPUS" -ge 2 ] && LAYOUTS="1x1 2x1 1x2"
  # shellcheck disable=SC2086
  step megatron_smoke 50 python3 examples/megatron/smoke_train.py --layouts $LAYOUTS --bf16 --steps 5 --enable-fp32-lm-head

  # The training loop on CUDA (#34): the tiny recipe for 4 rollouts (its start/end table), with the embedded learner,
  # then with the Megatron learner (Megatron's DDP, optimizer and schedules inside the loop)
  TINY=(--num-rollout 4 --eval-interval 4 --save-interval 4)
  step train_tiny 35 python3 examples/tiny_cpu/run.py --run-dir "$RUNS/tiny" -- --device cuda "${TINY[@]}"
  step train_tiny_megatron 35 python3 examples/tiny_cpu/run.py --run-dir "$RUNS/tiny_megatron" -- --device cuda \
    --train-backend megatron "${TINY[@]}"
  fi

  # The whole RL step, dense vs Sparse-RL (R-KV 512 + 128) at the same rollout memory, the engine warm across steps
  # (2 steps per mode, the first a warm-up), at the reduced size above; #43's size: profiles rl_step_dense / _sparse
  step rl_step_bench 70 "${RL_BENCH[@]}" "${RL[@]}"

  # SGLang plugin inside live servers (parity with the unpatched server, no leak, CUDA graphs, weight update)
  if [ -z "$DRY" ] && python3 -c "import sglang" 2>/dev/null; then
    step sglang_contract 60 python3 -m sglang_patches.contract
    step sglang_smoke 300 python3 examples/sglang/smoke.py --out "$OUT/sglang_smoke"
  else
    echo "=== sglang: skipped. SGLang is not installed, and it cannot be on the device machine's image: it reaches no" \
         "package registry, and SGLang's CUDA wheels (sgl-kernel, flashinfer) are hundreds of MB, far over the 64 MiB" \
         "a device call can carry. Run examples/sglang/smoke.py on a GPU node with SGLang (sglang_patches/README.md)."
    skip sglang "not installable here (no registry; its CUDA wheels exceed what a call carries)"
  fi
}

profile_targets() {
  env_step
  # per batch, every engine warmed by a call of the row's own length: batch 64 +128 (dense), batch 256 +4,096 (dense,
  # R-KV 512 + 128: the same-batch ratio and the compaction's share of the call)
  step rollout_batch 220 "${BENCH[@]}" --rows "$SHORT" "$LONG" --no-hf --repeats 1 --long-repeats 1 "${KV[@]}"
  # 24 GiB of total memory, +4,096: what fits, then a fixed wave and a length mix per config (mix first)
  step rollout_memory 245 "${BENCH[@]}" --rows "$MEM_ROW" --same-memory-only --same-memory-gib "$GIB" "${MIX[@]}" \
    --long-repeats 1 "${KV[@]}"
}

profile_rl_step_dense() {
  env_step
  step rl_step_dense 465 "${RL_BENCH[@]}" "${RL_FULL[@]}" --modes dense
}

profile_rl_step_sparse() {
  env_step
  step rl_step_sparse 465 "${RL_BENCH[@]}" "${RL_FULL[@]}" --modes sparse
}

case "$PROFILE" in
  all|targets|rl_step_dense|rl_step_sparse) "profile_$PROFILE" ;;
  *) echo "unknown profile $PROFILE: all | targets | rl_step_dense | rl_step_sparse" >&2; exit 2 ;;
esac

python3 tools/gpu_summary.py "$OUT" | tee "$OUT/summary.txt"
# the step logs as one file (the device call brings back at most 8)
(cd "$OUT" && tar -czf logs.tar.gz ./*.log && rm -f ./*.log)
rm -rf "$RUNS"
