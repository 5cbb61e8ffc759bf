"""What the mismatch split costs: the shadow forward (and the split's statistics) against the rest of a step.

Under --loss-type sparse_rl the split of the sampler/learner mismatch into its sparsity part (dense pi_old against
pi_shadow) and its numeric part (pi_shadow against the sampler) needs one forward the step does not otherwise run:
the learner's recompute under each sample's eviction record (`pipeline.shadow_logprobs_for_split`). This script
times, per row, what train.py does per rollout on the embedded path, one process, medians of interleaved repeats:

    rest   = generation (the embedded engine, R-KV)  +  pipeline.prepare_rollout (dense pi_old, the correction and
             its metrics)  +  the optimizer steps over the batch (fp32, --global-batch-size = a quarter of it)
    split  = the shadow forward + mismatch_split_metrics

and prints split / rest: the share of a step the split adds when it runs on every rollout. Under shadow / smd the
shadow forward is paid for by the loss, so the split costs only its statistics there. No KL reference forward is
counted in the rest (with one, the share is lower).

    python benchmarks/mismatch_split_cost.py --clock cpu               # the table of benchmarks/README.md
    python benchmarks/mismatch_split_cost.py --rows recipe:128:10:48:16 --repeats 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/mismatch_split_cost.py` from a checkout
    sys.path.insert(0, str(REPO))

from slime_sparse.rollout import pipeline  # noqa: E402
from slime_sparse.algo import CorrectionConfig, LossConfig, mismatch_split_metrics  # noqa: E402
from slime_sparse.backends.batching import MicroBatching  # noqa: E402
from slime_sparse.backends.embedded.learner import EmbeddedLearner  # noqa: E402
from slime_sparse.backends.logprobs import pad_right, response_mask  # noqa: E402
from slime_sparse.backends.optimizer import OptimConfig  # noqa: E402
from slime_sparse.kv import KVCompressConfig  # noqa: E402
from slime_sparse.rollout import SamplingParams  # noqa: E402
from slime_sparse.rollout.embedded import EmbeddedEngine  # noqa: E402
from slime_sparse.types import Sample  # noqa: E402
from slime_sparse.rollout.base_types import RolloutPlan  # noqa: E402

from benchmarks.rollout_runs import CLOCKS, PRESETS as BENCH_PRESETS, build_model  # noqa: E402

# the tiny recipe's model (slime_sparse/tasks/tiny_model.py: character vocabulary, 4 layers of 128) besides the
# rollout benchmark's shapes
MODELS = {**BENCH_PRESETS, "recipe": ("qwen2", dict(vocab_size=32, hidden_size=128, intermediate_size=256,
                                                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))}
SUITES = {
    "ci": ["tiny:8:8:32:12"],
    # the tiny recipe (16 prompts x 8, ~48 new tokens, budget 16); a 19M Qwen2 at longer responses; SmolLM2-135M's
    # shape at the real-model recipe's sizes (16 x 4 samples, ~60-token prompts, budget 32)
    "full": ["recipe:128:10:48:16", "qwen2-19m:32:64:256:64", "smollm2-135m:64:64:64:32"],
}


@dataclass(frozen=True)
class RowSpec:
    model: str
    batch: int
    prompt_len: int
    response_len: int
    budget: int

    @classmethod
    def parse(cls, text: str) -> "RowSpec":
        try:
            model, *nums = text.split(":")
            spec = cls(model, *(int(x) for x in nums))
        except (TypeError, ValueError):
            raise SystemExit(f"--rows {text!r}: expected MODEL:BATCH:PROMPT:RESPONSE:BUDGET with integers") from None
        if model not in MODELS:
            raise SystemExit(f"--rows {text!r}: unknown model {model!r}, known are {sorted(MODELS)}")
        if min(spec.batch, spec.prompt_len, spec.response_len, spec.budget) < 1 or spec.batch % 4:
            raise SystemExit(f"--rows {text!r}: sizes must be >= 1 and BATCH a multiple of 4 (groups of 4)")
        return spec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(SUITES), default="full")
    p.add_argument("--rows", nargs="+", default=None, help="MODEL:BATCH:PROMPT:RESPONSE:BUDGET rows instead of a suite")
    p.add_argument("--buffer", type=int, default=8, help="--kv-buffer")
    p.add_argument("--window", type=int, default=8, help="--kv-window")
    p.add_argument("--max-tokens-per-gpu", type=int, default=8192, help="micro-batch packing (slime's flag)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.rows = [RowSpec.parse(r) for r in (args.rows or SUITES[args.suite])]
    if args.repeats < 1 or args.threads < 1:
        p.error("--repeats and --threads must be >= 1")
    return args


def model_for(row: RowSpec, seed: int) -> torch.nn.Module:
    context = row.prompt_len + row.response_len + 8
    if row.model in BENCH_PRESETS:
        return build_model(row.model, context, seed=seed)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**MODELS[row.model][1], max_position_embeddings=context)).eval()


def rollout_samples(engine: EmbeddedEngine, row: RowSpec, vocab: int, seed: int) -> list[Sample]:
    """One rollout: BATCH / 4 prompts x 4 samples, RESPONSE new tokens each (random weights: no EOS stop)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (row.prompt_len,), generator=g).tolist() for _ in range(row.batch // 4)]
    params = SamplingParams(temperature=1.0, max_new_tokens=row.response_len, ignore_eos=True)
    outs = engine.generate([p for p in prompts for _ in range(4)], params, seed=seed)
    return [Sample(prompt_index=i // 4, prompt_ids=o.prompt_ids, response_ids=o.response_ids,
                   rollout_logprobs=o.logprobs, finish_reason=o.finish_reason,
                   reward=float(torch.rand((), generator=g) > 0.5), kv=o.kv, evictions=o.evictions)
            for i, o in enumerate(outs)]


def one_step(row: RowSpec, engine, learner, clock, seed: int) -> dict[str, float]:
    """What train.py runs per rollout (generation, prepare_rollout, the optimizer steps), each part timed, and the
    split on the same samples."""
    t0 = clock()
    samples = rollout_samples(engine, row, engine.model.config.vocab_size, seed)
    t1 = clock()
    prepared = pipeline.prepare_rollout(samples, learner, CorrectionConfig.from_preset("mis"),
                                        plan=RolloutPlan(metrics_due=False))
    t2 = clock()
    for part in pipeline.split_steps(prepared.batch, 4):
        learner.train_step(part)
    t3 = clock()
    # the split: one forward under the eviction records, then its statistics (the dense pi_old is the step's)
    old = prepared.batch.old_logprobs
    shadow = pipeline.shadow_logprobs_for_split(samples, learner, old)
    pad = lambda xs: pad_right(xs, 0.0, dtype=torch.float32)  # noqa: E731
    mismatch_split_metrics(pad(old), pad(shadow), pipeline.sampler_logprobs(samples),
                           response_mask([len(s.response_ids) for s in samples]))
    t4 = clock()
    return {"generate": t1 - t0, "prepare": t2 - t1, "train": t3 - t2, "split": t4 - t3,
            "compressed": sum(s.kv.compressions > 0 for s in samples) / len(samples)}


def run_row(row: RowSpec, args: argparse.Namespace) -> dict[str, float]:
    clock = CLOCKS[args.clock]
    model = model_for(row, args.seed)
    kv = KVCompressConfig(method="rkv", budget=row.budget, buffer=args.buffer, window=args.window)
    engine = EmbeddedEngine(model, kv, max_batch_size=row.batch)
    learner = EmbeddedLearner(model, LossConfig(), optim=OptimConfig(lr=1e-6),
                              batching=MicroBatching(max_tokens=args.max_tokens_per_gpu))
    one_step(row, engine, learner, clock, args.seed)  # warm-up: allocator, first-call paths
    steps = [one_step(row, engine, learner, clock, args.seed + 1 + k) for k in range(args.repeats)]
    med = {key: statistics.median(s[key] for s in steps) for key in steps[0]}
    med["rest"] = statistics.median(s["generate"] + s["prepare"] + s["train"] for s in steps)
    med["ratio"] = statistics.median(s["split"] / (s["generate"] + s["prepare"] + s["train"]) for s in steps)
    med["of_prepare"] = statistics.median(s["split"] / s["prepare"] for s in steps)
    return med


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"# {torch.get_num_threads()} thread(s), torch {torch.__version__}, fp32 CPU; {args.clock} clock; medians of "
          f"{args.repeats} steps after a warm-up; R-KV buffer {args.buffer}, window {args.window}; load average "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    print("| model | batch | prompt | new | budget | compressed | generate s | prepare s | train s | rest s | split s | "
          "split / rest | split / prepare |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in args.rows:
        m = run_row(row, args)
        print(f"| {row.model} | {row.batch} | {row.prompt_len} | {row.response_len} | {row.budget} | "
              f"{m['compressed']:.2f} | {m['generate']:.3f} | {m['prepare']:.3f} | {m['train']:.3f} | {m['rest']:.3f} | "
              f"{m['split']:.3f} | {100 * m['ratio']:.1f} % | {100 * m['of_prepare']:.0f} % |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
