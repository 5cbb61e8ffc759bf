#!/usr/bin/env python
"""Plan GPU memory for a Sparse-RL run before launching it: KV cache per rollout request (dense vs budgeted), how
many requests one SGLang server holds at once, what one GPU holds in each phase of a colocated step (engine and
learner on it, activations with and without recompute), and what the Megatron learner keeps per GPU.

    python tools/plan_memory.py --hf-config Qwen2.5-7B --prompt-len 512 --max-new-tokens 8192 \\
        --kv-method rkv --kv-budget 512 --kv-buffer 128 --learner-layouts 2x1x4 4x1x2
    python tools/plan_memory.py --hf-config Qwen2.5-7B --prompt-len 512 --max-new-tokens 8192 --gpus 8

--gpus N lists every TP x PP x DP layout of N GPUs, those that fit first (least recompute, then the fewest model-
parallel ranks); a layout the model cannot be split into (TP must divide the attention and KV heads, PP the
layers) is listed with the reason.

--hf-config is a model name this tool knows (Qwen2.5 0.5B-72B, Qwen3 0.6B-32B, Llama 3.1 8B / 70B, Llama 3.2 1B / 3B:
slime_sparse/planner/known_models.py), a config.json, or a model directory holding one. Every default is the trainer's
(`slime-sparse-train`): the same flag means the same thing here. Pure arithmetic (slime_sparse/planner/memory.py,
slime_sparse/planner/step_memory.py, and for the in-process engine slime_sparse/kv/engine_memory.py, the count its own
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
from slime_sparse.kv.engine_memory import KV_PART, engine_bytes, runner_capacity  # noqa: E402
from slime_sparse.kv.engine_memory import max_rows as engine_max_rows  # noqa: E402
from slime_sparse.kv.engine_memory import row_bytes as engine_row_bytes  # noqa: E402
from slime_sparse.planner.known_models import KNOWN_MODELS, known_config  # noqa: E402
from slime_sparse.planner.learner_layouts import (RECOMPUTE, describe_misfit, layouts_of, plan_layout,  # noqa: E402
                                                  rank_layouts)
from slime_sparse.planner.memory import GIB, plan_rollout  # noqa: E402
from slime_sparse.planner.step_memory import (MicroBatch, StepSpec, largest_micro_batch, phase_peaks,  # noqa: E402
                                              plan_step, train_activation_bytes)
from slime_sparse.rollout.embedded.engine import DEFAULT_MAX_BATCH_SIZE  # noqa: E402
from slime_sparse.rollout.sampling import SamplingParams  # noqa: E402
from slime_sparse.rollout.sglang.config import SGLangEngineConfig  # noqa: E402
from slime_sparse.utils.model_shape import ModelShape  # noqa: E402

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module's text as written, and every optional flag's default after its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and not action.required and action.default not in (None, [], argparse.SUPPRESS) \
                and "%(default)" not in text and not isinstance(action.default, bool):
            text += " (default: %(default)s)"
        return text


def parse_layout(text: str) -> tuple[int, int, int]:
    try:
        tp, pp, dp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--learner-layouts: expected TPxPPxDP such as 2x1x4, got {text!r}") from None
    if min(tp, pp, dp) < 1:
        raise SystemExit(f"--learner-layouts: {text!r}: TP, PP and DP must be >= 1")
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--hf-config", required=True, help="a known model name, an HF config.json, or its directory")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU")
    p.add_argument("--mem-fraction-static", type=float, default=SGLangEngineConfig.mem_fraction_static,
                   help="SGLang's weights + KV pool share (the trainer's --sglang-mem-fraction-static)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16", help="weights and KV cache")
    p.add_argument("--prompt-len", type=int, required=True, help="tokens of the longest prompt")
    p.add_argument("--max-new-tokens", type=int, default=SamplingParams.max_new_tokens,
                   help="the trainer's --rollout-max-response-len")
    p.add_argument("--kv-method", default="rkv", help="the compression compared with dense")
    p.add_argument("--kv-budget", type=int, default=KVCompressConfig.budget, help="the trainer's --kv-budget")
    p.add_argument("--kv-buffer", type=int, default=KVCompressConfig.buffer, help="the trainer's --kv-buffer")
    p.add_argument("--kv-window", type=int, default=KVCompressConfig.window, help="the trainer's --kv-window")
    p.add_argument("--kv-budget-schedule", choices=("uniform", "pyramid"), default=None,
                   help="per-layer budgets (unset: the method's); non-uniform is planned for a paged engine "
                        "with per-layer pages, which SGLang is not")
    p.add_argument("--kv-pyramid-beta", type=float, default=KVCompressConfig.pyramid_beta,
                   help="the trainer's --kv-pyramid-beta")
    step = p.add_argument_group("the colocated step on one GPU (embedded engine and learner)")
    step.add_argument("--rollout-batch-size", type=int, default=RolloutConfig.rollout_batch_size,
                      help="prompts per rollout")
    step.add_argument("--n-samples-per-prompt", type=int, default=RolloutConfig.n_samples_per_prompt,
                      help="samples per prompt")
    step.add_argument("--rollout-max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE,
                      help="sequences the engine decodes at once (the trainer's default without a memory size)")
    step.add_argument("--max-tokens-per-gpu", type=int, default=TrainConfig.max_tokens_per_gpu,
                      help="tokens of a learner micro-batch (padded)")
    step.add_argument("--train-backend", choices=("embedded", "megatron"), default=TrainConfig.train_backend,
                      help="the learner")
    step.add_argument("--no-offload-rollout", action="store_true",
                      help="the engine keeps its KV cache while the learner works (default: it gives it back)")
    step.add_argument("--rollout-kv-cache-gib", type=float, default=None,
                      help="also print the rows the in-process engine admits in this much memory for its KV and every "
                           "working set (its own count: slime_sparse/kv/engine_memory.py)")
    learner = p.add_argument_group("the Megatron learner over several GPUs")
    learner.add_argument("--learner-layouts", nargs="*", default=[], metavar="TPxPPxDP",
                         help="layouts to plan, such as 2x1x4 (default: none, or every layout of --gpus)")
    learner.add_argument("--gpus", type=int, default=None,
                         help="plan every TP x PP x DP layout of this many GPUs, those that fit first")
    p.add_argument("--use-kl-loss", action="store_true",
                   help="count the frozen reference model (default: off, as the trainer)")
    args = p.parse_args(argv)
    for name in ("prompt_len", "max_new_tokens", "rollout_batch_size", "n_samples_per_prompt", "max_tokens_per_gpu"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.gpus is not None and args.gpus < 1:
        p.error(f"--gpus={args.gpus} must be >= 1")
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
    print(f"model: {shape.num_parameters() / 1e9:.2f}B parameters, {shape.num_parameters() * b / GIB:.1f} GiB of "
          f"weights ({args.dtype}); KV {shape.kv_bytes_per_token(b) / 1024:.1f} KiB per token")
    try:
        dense = plan_rollout(shape, kv=None, **common)
        sparse = plan_rollout(shape, kv=kv, engine=engine, **common)
    except ValueError as exc:  # the weights alone overflow the server's share of one GPU
        print(f"one SGLang server (TP 1): {exc}: the server needs its weights split over GPUs (SGLang's --tp, "
              "the trainer's --rollout-num-gpus-per-engine), which this table does not plan\n")
    else:
        print_rollout(args, kv, engine, dense, sparse)

    print_step(args, shape, kv, b)

    if args.learner_layouts or args.gpus:
        print_layouts(args, shape, b)
    return 0


def print_rollout(args: argparse.Namespace, kv: KVCompressConfig, engine: str, dense, sparse) -> None:
    """KV per request and requests held by one TP-1 server, dense against `kv`."""
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


def print_layouts(args: argparse.Namespace, shape: ModelShape, b: int) -> None:
    """The Megatron learner per GPU for each layout asked for (--learner-layouts) or possible (--gpus), best first;
    a layout the model cannot be split into, with the reason."""
    mb = MicroBatch.fill(args.max_tokens_per_gpu, args.prompt_len, args.max_new_tokens)
    mb = MicroBatch(mb.tokens, mb.tokens, mb.seq_len)  # Megatron's logits cover every position
    acts = {r: train_activation_bytes(shape, mb, dtype_bytes=b, recompute=r, unfused_attention=True)
            for r in RECOMPUTE}
    gpu = int(args.gpu_gib * GIB)
    layouts = [parse_layout(t) for t in args.learner_layouts] + (layouts_of(args.gpus) if args.gpus else [])
    plans = [plan_layout(shape, tp, pp, dp, acts, args.use_kl_loss) for tp, pp, dp in dict.fromkeys(layouts)]
    plans = rank_layouts(plans, gpu) if args.gpus else plans
    print(f"\nMegatron learner per GPU (bf16 weights, fp32 grads, distributed Adam"
          f"{', reference model included' if args.use_kl_loss else ''}), and one micro-batch's activations "
          f"({mb.tokens:,} tokens, local layer spec; divided by TP as under sequence parallelism) by "
          "--recompute-granularity" + (f"; the layouts of {gpus_text(args.gpus)}, best first" if args.gpus else "") + ":")
    gib = format(args.gpu_gib, "g")
    print(f"{'TP x PP x DP':<16}{'state GiB':>10}{'+ none':>10}{'+ selective':>13}{'+ full':>10}"
          f"{'fits ' + gib + ' GiB (full)':>22}{'fits with':>12}")
    for plan in (p for p in plans if not p.problems):
        fits = plan.fits_with(gpu)
        total = [t / GIB for t in plan.total_bytes]
        print(f"{plan.name:<16}{plan.state_bytes / GIB:>10.1f}{total[0]:>10.1f}{total[1]:>13.1f}{total[2]:>10.1f}"
              f"{'yes' if plan.total_bytes[-1] <= gpu else 'no':>22}{fits or '-':>12}")
    for plan in (p for p in plans if not p.problems and p.fits_with(gpu) is None):
        print(f"  {plan.name} does not fit, even with full recompute: {describe_misfit(plan, gpu)}")
    for plan in (p for p in plans if p.problems):
        print(f"  {plan.name} is no layout of this model: {'; '.join(plan.problems)}")
    if args.gpus and not any(p.fits_with(gpu) for p in plans):
        print(f"no layout of {gpus_text(args.gpus)} fits {gib} GiB: more GPUs, a smaller --max-tokens-per-gpu, or a "
              "smaller model")


def gpus_text(n: int) -> str:
    return f"{n} GPU{'s' if n > 1 else ''}"


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
        f"{format(c[2], ',') if c[2] else 'none fits':>{width}}" for c in columns) + "   tokens: --max-tokens-per-gpu")
    if not all(c[2] for c in columns):
        print(colocated_misfit(shape, StepSpec(**{**step.__dict__, "max_tokens_per_gpu": longest, "recompute": "full"}),
                               args.gpu_gib, [c[0] for c in columns if not c[2]]))

    if args.rollout_kv_cache_gib:
        print_admission(args, shape, kv, b)


def colocated_misfit(shape: ModelShape, one_row: StepSpec, gpu_gib: float, names: list[str]) -> str:
    """Why the learner fits no micro-batch in `names`' columns, in words: one row under full recompute, and what the
    step holds throughout."""
    phases = plan_step(shape, one_row)
    held = sum(v for k, v in phases["weight update"].items() if k in ("engine weights", "learner weights", "optimizer",
                                                                          "gradients")) / GIB
    peak = max(phase_peaks(phases)[p] for p in ("recompute", "train")) / GIB
    return (f"none fits ({', '.join(names)}): the learner needs {peak:.1f} GiB for even one sequence of "
            f"{one_row.prompt_len + one_row.response_len:,} tokens under full recompute, {held:.1f} GiB of it the "
            f"weights (engine and learner copies{', reference' if one_row.with_ref else ''}), gradients and optimizer "
            f"state held throughout, against {gpu_gib:g} GiB: "
            + ("without --use-kl-loss (no reference copy) or " if one_row.with_ref else "")
            + "with a shorter --max-new-tokens it may; otherwise shard the learner (--train-backend megatron, "
            "--gpus N plans its layouts)")


def print_admission(args: argparse.Namespace, shape: ModelShape, kv: KVCompressConfig, b: int) -> None:
    """Rows the in-process engine admits in --rollout-kv-cache-gib, dense vs `kv`, and what they hold at the peak."""
    budget = int(args.rollout_kv_cache_gib * GIB)
    print(f"\nthe in-process engine in --rollout-kv-cache-gib {args.rollout_kv_cache_gib:g} (KV and every working set, "
          f"on a GPU with CUDA graphs, sampling at T=1):")
    print(f"{'':<14}{'rows':>8}{'KV + state GiB':>16}{'working sets GiB':>18}{'KV only: rows':>15}")
    for name, cfg in (("dense", KVCompressConfig()), (kv.method, kv)):
        capacity = runner_capacity(cfg, args.prompt_len + args.max_new_tokens, graphs=True)  # the engine's rounding
        spec = StepSpec(seqs=1, prompt_len=args.prompt_len, response_len=args.max_new_tokens, engine_rows=1,
                        kv_slots=capacity, dtype_bytes=b, kv=cfg).engine(shape)
        rows = engine_max_rows(spec, budget)
        parts = engine_bytes(spec, rows) if rows else {KV_PART: 0}
        kv_only = budget // engine_row_bytes(shape, cfg, capacity, b, spec.readback)
        print(f"{name:<14}{rows:>8,}{parts[KV_PART] / GIB:>16.2f}{(sum(parts.values()) - parts[KV_PART]) / GIB:>18.2f}"
              f"{kv_only:>15,}")


if __name__ == "__main__":
    sys.exit(main())
