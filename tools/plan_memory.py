#!/usr/bin/env python
"""Plan GPU memory for a Sparse-RL run before launching it: KV cache per rollout request (dense vs budgeted), how
many requests one SGLang server holds at once, what one GPU holds in each phase of a colocated step (engine and
learner on it, activations with and without recompute), and what the Megatron learner keeps per GPU.

    python tools/plan_memory.py --hf-config Qwen2.5-7B --prompt-len 512 --max-new-tokens 8192 \\
        --kv-method rkv --kv-budget 512 --kv-buffer 128 --learner-layouts 2x1x4 4x1x2

--hf-config is a model name this tool knows (Qwen2.5 0.5B-72B, Qwen3 0.6B-32B, Llama 3.1 8B / 70B, Llama 3.2 1B / 3B:
slime_sparse/kv/known_models.py), a config.json, or a model directory holding one. Every default is the trainer's
(`slime-sparse-train`): the same flag means the same thing here. Pure arithmetic (slime_sparse/kv/memory_plan.py,
slime_sparse/kv/step_memory.py, and for the in-process engine slime_sparse/kv/engine_memory.py, the count its own
admission uses): no GPU, no weights. The CUDA context and allocator fragmentation are not counted; treat the request
counts as upper bounds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime_sparse.config import RolloutConfig, TrainConfig  # noqa: E402  (the trainer's defaults)
from slime_sparse.kv import KVCompressConfig, row_capacity  # noqa: E402
from slime_sparse.kv.known_models import KNOWN_MODELS, known_config  # noqa: E402
from slime_sparse.kv.engine_memory import KV_PART, engine_bytes  # noqa: E402
from slime_sparse.kv.engine_memory import max_rows as engine_max_rows  # noqa: E402
from slime_sparse.kv.engine_memory import row_bytes as engine_row_bytes  # noqa: E402
from slime_sparse.kv.memory_plan import GIB, ModelShape, plan_learner, plan_rollout  # noqa: E402
from slime_sparse.kv.step_memory import (MicroBatch, StepSpec, largest_micro_batch, phase_peaks,  # noqa: E402
                                         plan_step, train_activation_bytes)
from slime_sparse.rollout.sampling import SamplingParams  # noqa: E402
from slime_sparse.rollout.sglang.config import SGLangEngineConfig  # noqa: E402

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def parse_layout(text: str) -> tuple[int, int, int]:
    try:
        tp, pp, dp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--learner-layouts: expected TPxPPxDP such as 2x1x4, got {text!r}") from None
    return tp, pp, dp


def read_shape(name_or_path: str) -> ModelShape:
    """A known model by name, else a config.json (or the directory holding it)."""
    config = known_config(name_or_path)
    if config is None:
        path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
        if not os.path.isfile(path):
            raise SystemExit(f"--hf-config {name_or_path!r}: neither a known model ({', '.join(KNOWN_MODELS)}) nor a "
                             "config.json or a directory holding one")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    try:
        return ModelShape.from_hf_config(config)
    except ValueError as exc:
        raise SystemExit(f"--hf-config {name_or_path!r}: {exc}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-config", required=True, help="a known model name, an HF config.json, or its directory")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU")
    p.add_argument("--mem-fraction-static", type=float, default=SGLangEngineConfig.mem_fraction_static,
                   help="SGLang's weights + KV pool share (the trainer's --sglang-mem-fraction-static)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--max-new-tokens", type=int, default=SamplingParams.max_new_tokens,
                   help="the trainer's --rollout-max-response-len")
    p.add_argument("--kv-method", default="rkv", help="the compression compared with dense")
    p.add_argument("--kv-budget", type=int, default=KVCompressConfig.budget)
    p.add_argument("--kv-buffer", type=int, default=KVCompressConfig.buffer)
    p.add_argument("--kv-window", type=int, default=KVCompressConfig.window)
    p.add_argument("--kv-budget-schedule", choices=("uniform", "pyramid"), default=None,
                   help="per-layer budgets (unset: the method's); non-uniform is planned for a paged engine "
                        "with per-layer pages, which SGLang is not")
    p.add_argument("--kv-pyramid-beta", type=float, default=10.0)
    step = p.add_argument_group("the colocated step on one GPU (embedded engine and learner)")
    step.add_argument("--rollout-batch-size", type=int, default=RolloutConfig.rollout_batch_size)
    step.add_argument("--n-samples-per-prompt", type=int, default=RolloutConfig.n_samples_per_prompt)
    step.add_argument("--rollout-max-batch-size", type=int, default=RolloutConfig.max_batch_size,
                      help="sequences the engine decodes at once")
    step.add_argument("--max-tokens-per-gpu", type=int, default=TrainConfig.max_tokens_per_gpu)
    step.add_argument("--train-backend", choices=("embedded", "megatron"), default=TrainConfig.train_backend)
    step.add_argument("--no-offload-rollout", action="store_true",
                      help="the engine keeps its KV cache while the learner works")
    step.add_argument("--rollout-kv-cache-gib", type=float, default=None,
                      help="also print the rows the in-process engine admits in this much memory for its KV and every "
                           "working set (its own count: slime_sparse/kv/engine_memory.py)")
    p.add_argument("--learner-layouts", nargs="*", default=[], metavar="TPxPPxDP")
    p.add_argument("--use-kl-loss", action="store_true", help="count the frozen reference model")
    args = p.parse_args(argv)
    for name in ("prompt_len", "max_new_tokens", "rollout_batch_size", "n_samples_per_prompt", "max_tokens_per_gpu"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = read_shape(args.hf_config)
    kv = KVCompressConfig(method=args.kv_method, budget=args.kv_budget, buffer=args.kv_buffer, window=args.kv_window,
                          granularity="model", budget_schedule=args.kv_budget_schedule,
                          pyramid_beta=args.kv_pyramid_beta)
    try:
        kv.validate(prefix="--kv-")
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    b = DTYPE_BYTES[args.dtype]
    engine = "sglang" if kv.schedule == "uniform" else "paged"
    common = dict(gpu_bytes=int(args.gpu_gib * GIB), mem_fraction_static=args.mem_fraction_static,
                  dtype_bytes=b, prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens)
    dense = plan_rollout(shape, kv=None, **common)
    sparse = plan_rollout(shape, kv=kv, engine=engine, **common)

    print(f"model: {shape.num_parameters() / 1e9:.2f}B parameters, {dense.weight_bytes / GIB:.1f} GiB of weights "
          f"({args.dtype}); KV {dense.kv_bytes_per_token / 1024:.1f} KiB per token")
    print(f"one SGLang server (TP 1): {args.gpu_gib:g} GiB x {args.mem_fraction_static} -> KV pool "
          f"{dense.kv_pool_bytes / GIB:.1f} GiB = {dense.kv_pool_tokens:,} tokens; requests of "
          f"{args.prompt_len} + {args.max_new_tokens} tokens\n")
    label = f"{args.kv_method} B={args.kv_budget} b={args.kv_buffer}" + (f" {kv.schedule}" if engine == "paged" else "")
    if engine == "paged":
        print(f"{label}: per-layer budgets, planned for a paged engine with per-layer pages (SGLang holds one slot "
              "per token for every layer and refuses them); peak slots = its largest layer's\n")
    rows = [("peak KV slots per request", f"{dense.peak_slots:,}", f"{sparse.peak_slots:,}"),
            ("peak KV per request (MiB)", f"{dense.bytes_per_request / 2**20:,.1f}",
             f"{sparse.bytes_per_request / 2**20:,.1f}"),
            ("requests held at once", f"{dense.max_requests:,}", f"{sparse.max_requests:,}")]
    width = max(26, len(label) + 2)
    print(f"{'':<30}{'dense':>14}{label:>{width}}")
    for name, x, y in rows:
        print(f"{name:<30}{x:>14}{y:>{width}}")
    if dense.max_requests:
        print(f"{'concurrency gain':<30}{'1.00x':>14}{sparse.max_requests / dense.max_requests:>{width - 1}.2f}x")

    print_step(args, shape, kv, b)

    if args.learner_layouts:
        mb = MicroBatch.fill(args.max_tokens_per_gpu, args.prompt_len, args.max_new_tokens)
        mb = MicroBatch(mb.tokens, mb.tokens, mb.seq_len)  # Megatron's logits cover every position
        acts = {r: train_activation_bytes(shape, mb, dtype_bytes=b, recompute=r, unfused_attention=True)
                for r in (None, "selective", "full")}
        print(f"\nMegatron learner per GPU (bf16 weights, fp32 grads, distributed Adam"
              f"{', reference model included' if args.use_kl_loss else ''}), and one micro-batch's activations "
              f"({mb.tokens:,} tokens, local layer spec; divided by TP as under sequence parallelism) by "
              "--recompute-granularity:")
        print(f"{'TP x PP x DP':<16}{'state GiB':>10}{'+ none':>10}{'+ selective':>13}{'+ full':>10}"
              f"{'fits ' + format(args.gpu_gib, 'g') + ' GiB (full)':>22}")
        for text in args.learner_layouts:
            tp, pp, dp = parse_layout(text)
            state = plan_learner(shape, tp=tp, pp=pp, dp=dp, with_ref=args.use_kl_loss).bytes_per_gpu
            total = {r: (state + a / tp / pp) / GIB for r, a in acts.items()}  # a stage holds its layers' share
            print(f"{text:<16}{state / GIB:>10.1f}{total[None]:>10.1f}{total['selective']:>13.1f}{total['full']:>10.1f}"
                  f"{'yes' if total['full'] < args.gpu_gib else 'no':>22}")
    return 0


def print_step(args: argparse.Namespace, shape: ModelShape, kv: KVCompressConfig, b: int) -> None:
    """The colocated step's peak per phase (GiB), dense vs `kv` rollouts, without and with activation recompute."""
    seqs = args.rollout_batch_size * args.n_samples_per_prompt
    longest = args.prompt_len + args.max_new_tokens
    rows = min(args.rollout_max_batch_size, seqs)
    print(f"\nthe colocated step on one GPU ({args.train_backend} learner, {args.dtype}): {seqs} samples of "
          f"{args.prompt_len} + {args.max_new_tokens} tokens, {rows} decoded at once, micro-batches of "
          f"{args.max_tokens_per_gpu:,} tokens; KV cache {'kept' if args.no_offload_rollout else 'given back'} "
          f"while the learner works")
    columns = []
    for name, cfg in (("dense", KVCompressConfig()), (kv.method, kv)):
        for recompute in ("none", "full"):
            step = StepSpec(seqs=seqs, prompt_len=args.prompt_len, response_len=args.max_new_tokens, engine_rows=rows,
                            kv_slots=row_capacity(cfg, longest), kv_window=cfg.window if cfg.enabled else 0,
                            max_tokens_per_gpu=args.max_tokens_per_gpu, recompute=None if recompute == "none" else recompute,
                            dtype_bytes=b,
                            learner=args.train_backend, offload_rollout=not args.no_offload_rollout,
                            with_ref=args.use_kl_loss, kv=cfg)
            largest = largest_micro_batch(shape, step, int(args.gpu_gib * GIB))
            columns.append((f"{name}/{recompute}", phase_peaks(plan_step(shape, step)), largest))
    width = max(13, max(len(c[0]) for c in columns) + 2)
    print(f"{'GiB at the peak of':<30}" + "".join(f"{c[0]:>{width}}" for c in columns)
          + "   (rollout KV / --recompute-granularity)")
    for phase in columns[0][1]:
        print(f"{phase:<30}" + "".join(f"{c[1][phase] / GIB:>{width}.1f}" for c in columns))
    fits = [("yes" if max(c[1].values()) <= args.gpu_gib * GIB else "no") for c in columns]
    print(f"{'fits ' + format(args.gpu_gib, 'g') + ' GiB':<30}" + "".join(f"{f:>{width}}" for f in fits))
    print(f"{'largest micro-batch (learner)':<30}" + "".join(
        f"{format(c[2], ',') if c[2] else 'none':>{width}}" for c in columns) + "   tokens: --max-tokens-per-gpu")
    if args.rollout_kv_cache_gib:
        print_admission(args, shape, kv, b)


def print_admission(args: argparse.Namespace, shape: ModelShape, kv: KVCompressConfig, b: int) -> None:
    """Rows the in-process engine admits in --rollout-kv-cache-gib, dense vs `kv`, and what they hold at the peak."""
    budget = int(args.rollout_kv_cache_gib * GIB)
    print(f"\nthe in-process engine in --rollout-kv-cache-gib {args.rollout_kv_cache_gib:g} (KV and every working set, "
          f"on a GPU with CUDA graphs, sampling at T=1):")
    print(f"{'':<14}{'rows':>8}{'KV + state GiB':>16}{'working sets GiB':>18}{'KV only: rows':>15}")
    for name, cfg in (("dense", KVCompressConfig()), (kv.method, kv)):
        capacity = row_capacity(cfg, args.prompt_len + args.max_new_tokens)
        spec = StepSpec(seqs=1, prompt_len=args.prompt_len, response_len=args.max_new_tokens, engine_rows=1,
                        kv_slots=capacity, dtype_bytes=b, kv=cfg).engine(shape)
        rows = engine_max_rows(spec, budget)
        parts = engine_bytes(spec, rows) if rows else {KV_PART: 0}
        kv_only = budget // engine_row_bytes(shape, cfg, capacity, b, spec.readback)
        print(f"{name:<14}{rows:>8,}{parts[KV_PART] / GIB:>16.2f}{(sum(parts.values()) - parts[KV_PART]) / GIB:>18.2f}"
              f"{kv_only:>15,}")


if __name__ == "__main__":
    sys.exit(main())
