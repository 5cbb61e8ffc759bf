"""Learner-step cost of Sparse-RL's sparsity correction and metrics over plain GRPO, one process.

A step is what train.py runs per rollout on the embedded learner: GRPO advantages, the dense recompute of pi_old
(and of pi_ref under --use-kl-loss), then one optimizer step over the batch. Two variants, interleaved
(plain, sparse, plain, sparse, ...), medians reported:
- plain:  GRPO alone: every response token trains with weight 1, pi_sparse is not looked at, no mismatch/KV metrics;
- sparse: `pipeline.prepare_rollout` with the correction preset (default mis: weights, token masks, sequence veto,
          batch normalisation) and its metrics (correction/*, mismatch/*, kv/*), the weights multiplied in the loss.
Columns: seconds per step of each, the overhead (sparse / plain - 1: both under the same load, but the difference
of two noisy times), and the correction + metrics time measured inside the sparse step (the pipeline's
sparsity_correction / mismatch_metrics / kv_metrics calls and the padding of their outputs, timed around each
call) as a share of the plain step: the precise number, the one the <= 2 % target is about.
A second table shows the pi_ref recompute: --use-kl-loss with --kl-loss-coef > 0 runs the reference model on
every rollout; with coefficient 0 (slime's GRPO scripts) nothing multiplies it, so no reference model is built or run.

    python benchmarks/learner_bench.py                          # the table of benchmarks/README.md
    python benchmarks/learner_bench.py --rows qwen2-19m:32:256:512 --clock cpu
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/learner_bench.py` from a checkout
    sys.path.insert(0, str(REPO))

from slime_sparse.rollout import pipeline  # noqa: E402
from slime_sparse.algo import CorrectionConfig, LossConfig, grpo_advantages  # noqa: E402
from slime_sparse.backends.base import TrainBatch  # noqa: E402
from slime_sparse.backends.batching import MicroBatching  # noqa: E402
from slime_sparse.backends.embedded.learner import EmbeddedLearner  # noqa: E402
from slime_sparse.backends.optimizer import OptimConfig  # noqa: E402
from slime_sparse.types import KVStats, Sample  # noqa: E402

from benchmarks.rollout_runs import CLOCKS, PRESETS, build_model  # noqa: E402  (one list of model shapes)

SUITES = {
    "ci": ["tiny:8:16:24"],
    # The correction's cost grows with the tokens of a step, the step's with tokens x parameters: the smallest
    # rows bound its share from above.
    "full": ["qwen2-19m:8:32:64", "qwen2-19m:16:64:128", "qwen2-19m:32:128:256", "smollm2-135m:16:128:256"],
}
TIMED = ("judge_rows", "batch_correction", "mismatch_metrics", "kv_metrics", "pad_right")  # the pipeline's, wrapped


@dataclass(frozen=True)
class RowSpec:
    model: str
    batch: int
    prompt_len: int
    response_len: int

    @classmethod
    def parse(cls, text: str) -> "RowSpec":
        try:
            model, *nums = text.split(":")
            spec = cls(model, *(int(x) for x in nums))
        except (TypeError, ValueError):
            raise SystemExit(f"--rows {text!r}: expected MODEL:BATCH:PROMPT:RESPONSE with integers") from None
        if model not in PRESETS:
            raise SystemExit(f"--rows {text!r}: unknown model {model!r}, presets are {sorted(PRESETS)}")
        if min(spec.batch, spec.prompt_len, spec.response_len) < 1 or spec.batch % 4:
            raise SystemExit(f"--rows {text!r}: sizes must be >= 1 and BATCH a multiple of 4 (groups of 4)")
        return spec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(SUITES), default="full")
    p.add_argument("--rows", nargs="+", default=None, help="MODEL:BATCH:PROMPT:RESPONSE rows instead of a suite")
    p.add_argument("--correction-preset", default="mis", choices=["paper", "mis"])
    p.add_argument("--max-tokens-per-gpu", type=int, default=4096, help="micro-batch packing (slime's flag)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.rows = [RowSpec.parse(r) for r in (args.rows or SUITES[args.suite])]
    if args.repeats < 1 or args.threads < 1:
        p.error("--repeats and --threads must be >= 1")
    return args


def make_samples(row: RowSpec, vocab: int, seed: int) -> list[Sample]:
    """Groups of 4 samples per prompt, responses of varied length (R/2..R), rewards 0/1, sampler log-probs drawn
    around the learner's typical values, so the correction weights, masks and vetoes all have work to do."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(row.batch):
        n = int(torch.randint(row.response_len // 2, row.response_len + 1, (1,), generator=g))
        prompt = torch.randint(0, vocab, (row.prompt_len,), generator=g).tolist()
        logps = (-torch.rand(n, generator=g) * 12).tolist()  # a random model: log-probs near -log(vocab)
        out.append(Sample(prompt_index=i // 4, prompt_ids=prompt, response_ids=torch.randint(0, vocab, (n,), generator=g).tolist(),
                          rollout_logprobs=logps, finish_reason="length", reward=float(torch.rand((), generator=g) > 0.5),
                          kv=KVStats(dense_kv_tokens=n * (row.prompt_len + n // 2), kept_kv_tokens=n * 300,
                                     peak_kv_tokens=320, compressions=n // 64)))
    return out


def plain_batch(samples: list[Sample], learner) -> TrainBatch:
    """Plain GRPO: advantages, dense pi_old, every response token trained with weight 1."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    advantages, _ = grpo_advantages(rewards, torch.tensor([s.prompt_index for s in samples]))
    tokens = [s.prompt_ids + s.response_ids for s in samples]
    response_lens = [len(s.response_ids) for s in samples]
    old = learner.compute_logprobs(tokens, response_lens)
    return TrainBatch(tokens=tokens, response_lens=response_lens, advantages=advantages,
                      loss_masks=[torch.ones(n) for n in response_lens], old_logprobs=old).as_step()


class Timers:
    """Wraps the pipeline's correction and metric functions with one accumulating timer."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock, self.seconds = clock, 0.0
        self.originals = {name: getattr(pipeline, name) for name in TIMED}

    def __enter__(self) -> "Timers":
        for name, fn in self.originals.items():
            setattr(pipeline, name, self._timed(fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.originals.items():
            setattr(pipeline, name, fn)

    def _timed(self, fn):
        def wrapper(*a, **k):
            t0 = self.clock()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += self.clock() - t0
        return wrapper


def learner_for(model: torch.nn.Module, args, loss: LossConfig) -> EmbeddedLearner:
    # lr 0: every step does the optimizer's full work but leaves the weights as they were, so steps stay comparable
    return EmbeddedLearner(copy.deepcopy(model), loss, optim=OptimConfig(lr=0.0),
                           batching=MicroBatching(max_tokens=args.max_tokens_per_gpu), need_ref=loss.needs_ref)


def run_correction_row(row: RowSpec, args, clock) -> str:
    model = build_model(row.model, row.prompt_len + row.response_len + 1, seed=args.seed).train()
    samples = make_samples(row, model.config.vocab_size, args.seed)
    learner = learner_for(model, args, LossConfig())
    correction = CorrectionConfig.from_preset(args.correction_preset)

    def plain() -> tuple[float, float]:
        t0 = clock()
        learner.train_step(plain_batch(samples, learner))
        return clock() - t0, 0.0

    def sparse() -> tuple[float, float]:
        with Timers(clock) as timers:
            t0 = clock()
            prepared = pipeline.prepare_rollout(samples, learner, correction)
            learner.train_step(prepared.batch.as_step())
            total = clock() - t0
        return total, timers.seconds

    plain(), sparse()  # warm-up
    runs = {"plain": [], "sparse": []}
    for _ in range(args.repeats):
        runs["plain"].append(plain())
        runs["sparse"].append(sparse())
    t_plain = statistics.median(t for t, _ in runs["plain"])
    t_sparse = statistics.median(t for t, _ in runs["sparse"])
    t_corr = statistics.median(c for _, c in runs["sparse"])
    tokens = sum(len(s.response_ids) for s in samples)
    return (f"| {row.model} | {row.batch} | {row.prompt_len} | {tokens / row.batch:.0f} | {args.correction_preset} | "
            f"{t_plain:.3f} | {t_sparse:.3f} | {100 * (t_sparse / t_plain - 1):+.1f} | {1e3 * t_corr:.1f} | "
            f"{100 * t_corr / t_plain:.2f} |")


def run_ref_row(row: RowSpec, args, clock) -> str:
    """One step with --use-kl-loss at coefficient 1e-3 (pi_ref recomputed) and at 0 (no reference model)."""
    model = build_model(row.model, row.prompt_len + row.response_len + 1, seed=args.seed).train()
    samples = make_samples(row, model.config.vocab_size, args.seed)
    correction = CorrectionConfig.from_preset(args.correction_preset)
    learners = {coef: learner_for(model, args, LossConfig(use_kl_loss=True, kl_loss_coef=coef)) for coef in (1e-3, 0.0)}

    def step(coef: float) -> float:
        learner = learners[coef]
        t0 = clock()
        prepared = pipeline.prepare_rollout(samples, learner, correction, need_ref=learner.loss_cfg.needs_ref)
        learner.train_step(prepared.batch.as_step())
        return clock() - t0

    step(1e-3), step(0.0)  # warm-up
    times: dict[float, list[float]] = {1e-3: [], 0.0: []}
    for _ in range(args.repeats):
        for coef in times:
            times[coef].append(step(coef))
    with_ref, without = (statistics.median(times[c]) for c in (1e-3, 0.0))
    return (f"| {row.model} | {row.batch} | {row.prompt_len} | {with_ref:.3f} | {without:.3f} | "
            f"{100 * (1 - without / with_ref):.1f} |")


CORRECTION_HEADER = ("| model | batch | prompt | mean response | correction | plain GRPO s/step | Sparse-RL s/step "
                     "| overhead % | correction + metrics ms | ... % of plain step |\n" + "|---" * 10 + "|")
REF_HEADER = ("| model | batch | prompt | kl coef 1e-3 (pi_ref run) s/step | kl coef 0 (no pi_ref) s/step "
              "| saved % |\n" + "|---" * 6 + "|")


def main(argv: list[str] | None = None) -> tuple[list[str], list[str]]:
    args = parse_args(argv)
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    import os

    load = os.getloadavg()
    print(f"# {torch.get_num_threads()} thread(s), torch {torch.__version__}; {args.clock} clock; medians of "
          f"{args.repeats} interleaved steps; --max-tokens-per-gpu {args.max_tokens_per_gpu}; "
          f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    print(CORRECTION_HEADER)
    corr = []
    for row in args.rows:
        corr.append(run_correction_row(row, args, clock))
        print(corr[-1], flush=True)
    print()
    print(REF_HEADER)
    ref = []
    for row in args.rows:
        ref.append(run_ref_row(row, args, clock))
        print(ref[-1], flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")
    return corr, ref


if __name__ == "__main__":
    main()
