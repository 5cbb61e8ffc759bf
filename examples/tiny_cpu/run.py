"""The main job: a small Sparse-RL run on CPU, end to end, in a few minutes on 2 cores.

    python examples/tiny_cpu/run.py                           # Sparse-RL: R-KV rollouts + the authors' `mis` correction
    python examples/tiny_cpu/run.py --variant dense           # dense GRPO (evaluated under R-KV too)
    python examples/tiny_cpu/run.py --variant naive_sparse    # R-KV rollouts, no correction
    python examples/tiny_cpu/run.py -- --num-rollout 4        # anything after -- goes to slime-sparse-train

1. Builds (or reuses, keyed by a hash of their parameters) the task data, a character tokenizer and a
   tiny Qwen2 with a supervised warm start (slime_sparse/tasks), under .cache/tiny_assets.
2. Trains it with the one training loop (slime_sparse/train.py): GRPO on R-KV rollouts whose KV budget is
   about half of a worked answer, evaluating greedily under dense and sparse (R-KV) inference as it goes.
3. Prints a start-vs-end table (learning, KV savings, rejection, mismatch) and writes PNG plots next to
   the metrics (runs/tiny_cpu_<variant>/). The variants side by side over seeds: compare.py (the study).
Rerunning the same command resumes from the last checkpoint (a finished run just re-prints its table).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import yaml

from slime_sparse.tasks.assets import AssetsConfig, build_assets
from slime_sparse.train import main as train_main
from slime_sparse.utils.logging import read_metrics
from slime_sparse.utils.plots import SUMMARY_FILE, plot_metrics

# A variant is a name and the flags it adds to the recipe; the study (compare.py) runs every row on the same
# seeds. Add a row to compare another configuration of the same loop.
VARIANTS: dict[str, list[str]] = {
    "dense": ["--kv-method", "none", "--correction-preset", "none", "--eval-kv-method", "rkv"],
    "naive_sparse": ["--kv-method", "rkv", "--correction-preset", "none"],
    "sparse_rl": ["--kv-method", "rkv", "--correction-preset", "mis"],
    "sparse_rl_paper": ["--kv-method", "rkv", "--correction-preset", "paper"],
    # beyond the paper's comparison (compare.py runs them when named in --variants):
    # dynamic sampling (#18): refill the batch with groups that carry a gradient and enough kept samples
    "sparse_rl_ds": ["--kv-method", "rkv", "--correction-preset", "mis",
                     "--dynamic-sampling-filter-path", "check_reward_nonzero_std", "check_min_kept_samples"],
    # Shadow Mask Distillation's answer to the same mismatch (#15): GRPO on the sampler's own masked policy
    "shadow": ["--kv-method", "rkv", "--correction-preset", "none", "--loss-type", "shadow"],
    "smd": ["--kv-method", "rkv", "--correction-preset", "none", "--loss-type", "smd", "--smd-kl-coef", "0.1"],
    # one importance weight per sequence (verl's decoupled_seq_is: the product of xi, truncated at 2): it reweights
    # the sequence's advantage too, where a token weight reweights only its own token (long_horizon.py, #38)
    "sparse_rl_seq_is": ["--kv-method", "rkv", "--correction-preset", "decoupled_seq_is"],
    # rollout k + 1 generated while the learner trains on rollout k (#47; slime's train_async): one version stale
    "sparse_rl_async": ["--kv-method", "rkv", "--correction-preset", "mis", "--async", "--rm-num-workers", "1"],
}
PAPER_VARIANTS = ["dense", "naive_sparse", "sparse_rl", "sparse_rl_paper"]  # the study's default rows

# The tasks' defaults: a ~0.6M-parameter Qwen2 warm-started for 400 steps on demonstrations of which 55 % give
# the bare answer ("#70") instead of the worked countdown (and a quarter are trained under a prompt + recent
# window mask). The model imitates both: greedy decoding answers bare for ~3/4 of the prompts, a guess that is
# rarely right, while its scratchpad is right most of the time. What GRPO has to learn is real: write the
# scratchpad, and write it without slips (temperature-1 accuracy of the scratchpad itself also rises).
ASSETS = AssetsConfig()

# Worked answers are 35-85 tokens; R-KV keeps 20 of them (+ a buffer of 2, window 8): ~45 % of the KV tokens of
# a rollout stay out of memory while `mis` rejects ~5-10 % of the sequences, the paper's regime (35-53 % saved, ~7 %
# rejected). Budget 16 saves ~53 % but rejects ~16-18 % and sparse accuracy stays flat: a budget too small (the
# ablations). 12 rollouts: the policy learns within the first 5.
RECIPE = [
    "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "32",
    "--rollout-max-response-len", "96", "--rollout-temperature", "1.0", "--rollout-max-batch-size", "128",
    "--kv-budget", "20", "--kv-buffer", "2", "--kv-window", "8",
    "--lr", "3e-5", "--weight-decay", "0.0", "--adam-beta2", "0.98", "--clip-grad", "1.0", "--eps-clip", "0.2",
    "--num-rollout", "12", "--eval-interval", "6", "--save-interval", "6", "--seed", "1",
    "--n-samples-per-eval-prompt", "1", "--eval-max-prompts", "128", "--rm-num-workers", "0",
    "--custom-rm-path", "slime_sparse.tasks.repeated_add:task_reward",
]

Row = tuple[str, float, float, str]  # (label, start, end, format)


def eval_series(records: list[dict], mode: str) -> dict[int, float]:
    """step -> greedy pass@1 under `mode` ("dense" or "sparse") inference."""
    key = f"eval_{mode}/pass@1"
    return {r["step"]: r[key] for r in records if r.get(key) is not None}


def summarize(run_dir: str) -> tuple[list[Row], str]:
    """Start and end of every headline metric of a run, and a footnote saying what start/end mean."""
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    rows = [r for r in records if "rollout/reward_mean" in r]

    def mean(key: str, part: list[dict]) -> float:
        vals = [r[key] for r in part if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    k = max(1, len(rows) // 4)  # first / last quarter of the run, to average out sampling noise
    first, last = rows[:k], rows[-k:]
    out: list[Row] = []
    for mode, label in (("dense", "eval accuracy, dense inference (greedy)"),
                        ("sparse", "eval accuracy, sparse inference (greedy)")):
        series = eval_series(records, mode)
        if series:
            out.append((label, series[min(series)], series[max(series)], ".3f"))
    for key, label, fmt in (
        ("rollout/reward_mean", "rollout reward (temperature 1)", ".3f"),
        ("rollout/response_len_mean", "response length (tokens)", ".1f"),
        ("kv/savings", "KV token savings", ".3f"),
        ("kv/peak_tokens_max", "peak KV tokens per sequence", ".0f"),
        ("correction/seq_reject_rate", "sequence rejection rate", ".4f"),
        ("correction/token_reject_rate", "token rejection rate", ".4f"),
        ("mismatch/k3", "mismatch KL k3 (pi_old || pi_sparse)", ".4f"),
        ("mismatch/k1", "mismatch KL k1", ".4f"),
        ("pg_clipfrac", "PPO clip fraction", ".4f"),
    ):
        out.append((label, mean(key, first), mean(key, last), fmt))
    return out, (f"(start/end: first/last evaluation for accuracies; mean of the first/last {k} of {len(rows)} "
                 "rollouts otherwise)")


def run_title(run_dir: str, variant: str) -> str:
    """What the run trained, from its own config.yaml (flags after `--` included): the variant, the advantage
    estimator, the loss, the correction and the rollouts' KV cache."""
    with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    kv = cfg["kv"]
    cache = "dense" if kv["method"] == "none" else f"{kv['method']} {kv['budget']} + {kv['buffer']}"
    return (f"tiny run ({variant}): {cfg['rollout']['advantage_estimator']} advantages, {cfg['loss']['loss_type']} "
            f"loss, correction {cfg['correction']['preset']}, rollouts under KV {cache}")


def summary_table(run_dir: str) -> str:
    metrics, footnote = summarize(run_dir)
    lines = [f"{'metric':<42} {'start':>9} {'end':>9} {'change':>9}", "-" * 72]
    for label, start, end, fmt in metrics:
        change = f"{end - start:+{fmt}}" if not fmt.endswith("0f") else ""
        lines.append(f"{label:<42} {start:>9{fmt}} {end:>9{fmt}} {change:>9}")
    return "\n".join([*lines, footnote])


def main(argv: list[str] | None = None, assets_config: AssetsConfig | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="sparse_rl")
    parser.add_argument("--cache-dir", default=".cache/tiny_assets")
    parser.add_argument("--run-dir", default=None, help="default: runs/tiny_cpu_<variant>")
    parser.add_argument("--assets-only", action="store_true",
                        help="build (or find) the assets and stop (tools/fetch_gpu_wheels.sh prepares a GPU run so)")
    parser.add_argument("--threads", type=int, default=None, help=(
        "torch threads of the training run, the trainer's --threads (default: the trainer's rule, one per 50M "
        "parameters: 1 for this model, so the run's digits do not depend on the machine's core count; the warm "
        "start always runs on one thread)"))
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads={args.threads} must be >= 1")
    return run(args, extra, assets_config or ASSETS)


def run(args: argparse.Namespace, extra: list[str], assets_config: AssetsConfig) -> int:
    run_dir = args.run_dir or f"runs/tiny_cpu_{args.variant}"

    # progress lines (the warm start's, the rollouts') go to the log when stderr is not a terminal
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    t0, c0 = time.perf_counter(), time.process_time()
    assets = build_assets(args.cache_dir, assets_config)
    meta = json.loads(assets.metadata_path.read_text())
    print(f"assets ready in {time.perf_counter() - t0:.0f}s ({time.process_time() - c0:.0f}s CPU, "
          f"{meta.get('num_parameters')} parameters): {assets.root}")
    if args.assets_only:
        return 0

    t1, c1 = time.perf_counter(), time.process_time()
    threads = [] if args.threads is None else ["--threads", str(args.threads)]
    rc = train_main([
        "--hf-checkpoint", str(assets.model_dir), "--prompt-data", str(assets.train_path),
        "--eval-prompt-data", str(assets.test_path), "--run-dir", run_dir, *RECIPE, *VARIANTS[args.variant],
        *threads, *extra,
    ])
    if rc:
        return rc
    # plots only when the metrics are newer (a rerun of a complete run changes nothing in its directory)
    summary_png = os.path.join(run_dir, "plots", SUMMARY_FILE)
    if not os.path.isfile(summary_png) or \
            os.path.getmtime(summary_png) < os.path.getmtime(os.path.join(run_dir, "metrics.jsonl")):
        plot_metrics(run_dir)
    # CPU time (all threads) next to wall time: on a shared machine the wall clock says little
    print(f"\n{run_title(run_dir, args.variant)}: {time.perf_counter() - t1:.0f}s of training "
          f"({time.process_time() - c1:.0f}s CPU), {time.perf_counter() - t0:.0f}s in all\n")
    print(summary_table(run_dir))
    print(f"\nmetrics: {run_dir}/metrics.jsonl   plots: {os.path.dirname(summary_png)}")
    print("dense GRPO, naive sparse and Sparse-RL side by side over seeds: python examples/tiny_cpu/compare.py "
          "(the measured study: examples/tiny_cpu/README.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
