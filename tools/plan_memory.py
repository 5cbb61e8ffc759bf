#!/usr/bin/env python
"""Plan GPU memory for a Sparse-RL run before launching it: KV cache per rollout request (dense vs budgeted),
how many requests one SGLang server holds at once, and what the Megatron learner keeps per GPU.

    python tools/plan_memory.py --hf-config Qwen2.5-7B/config.json --gpu-gib 80 --prompt-len 512 \\
        --max-new-tokens 8192 --kv-method rkv --kv-budget 512 --kv-buffer 128 --learner-layouts 2x1x4 4x1x2

Pure arithmetic (slime_sparse/kv/memory_plan.py): no GPU, no model weights, only config.json.
Activations and CUDA graphs are not counted; treat the request counts as upper bounds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def parse_layout(text: str) -> tuple[int, int, int]:
    try:
        tp, pp, dp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--learner-layouts: expected TPxPPxDP such as 2x1x4, got {text!r}") from None
    return tp, pp, dp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-config", required=True, help="an HF config.json, or the model directory holding it")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU")
    parser.add_argument("--mem-fraction-static", type=float, default=0.8, help="SGLang's weights + KV pool share")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    parser.add_argument("--prompt-len", type=int, required=True)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--kv-method", default="rkv")
    parser.add_argument("--kv-budget", type=int, default=512)
    parser.add_argument("--kv-buffer", type=int, default=128)
    parser.add_argument("--kv-window", type=int, default=8)
    parser.add_argument("--kv-budget-schedule", choices=("uniform", "pyramid"), default=None,
                        help="per-layer budgets (unset: the method's); non-uniform is planned for a paged engine "
                             "with per-layer pages, which SGLang is not")
    parser.add_argument("--kv-pyramid-beta", type=float, default=10.0)
    parser.add_argument("--learner-layouts", nargs="*", default=[], metavar="TPxPPxDP")
    parser.add_argument("--use-kl-loss", action="store_true", help="count the frozen reference model")
    args = parser.parse_args(argv)

    from slime_sparse.kv import KVCompressConfig
    from slime_sparse.kv.memory_plan import GIB, ModelShape, plan_learner, plan_rollout

    path = os.path.join(args.hf_config, "config.json") if os.path.isdir(args.hf_config) else args.hf_config
    with open(path, encoding="utf-8") as f:
        shape = ModelShape.from_hf_config(json.load(f))
    kv = KVCompressConfig(method=args.kv_method, budget=args.kv_budget, buffer=args.kv_buffer, window=args.kv_window,
                          granularity="model", budget_schedule=args.kv_budget_schedule,
                          pyramid_beta=args.kv_pyramid_beta)
    kv.validate(prefix="--kv-")
    engine = "sglang" if kv.schedule == "uniform" else "paged"
    common = dict(gpu_bytes=int(args.gpu_gib * GIB), mem_fraction_static=args.mem_fraction_static,
                  dtype_bytes=DTYPE_BYTES[args.dtype], prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens)
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
    for name, a, b in rows:
        print(f"{name:<30}{a:>14}{b:>{width}}")
    if dense.max_requests:
        print(f"{'concurrency gain':<30}{'1.00x':>14}{sparse.max_requests / dense.max_requests:>{width - 1}.2f}x")

    if args.learner_layouts:
        print(f"\nMegatron learner per GPU (bf16 weights, fp32 grads, distributed Adam; activations not counted"
              f"{', reference model included' if args.use_kl_loss else ''}):")
        print(f"{'TP x PP x DP':<16}{'GiB per GPU':>12}{'fits ' + format(args.gpu_gib, 'g') + ' GiB':>14}")
        for text in args.learner_layouts:
            tp, pp, dp = parse_layout(text)
            plan = plan_learner(shape, tp=tp, pp=pp, dp=dp, with_ref=args.use_kl_loss)
            gib = plan.bytes_per_gpu / GIB
            print(f"{text:<16}{gib:>12.1f}{'yes' if gib < args.gpu_gib else 'no':>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
