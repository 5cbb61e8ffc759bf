"""The ablations readers of Sparse-RL ask for, on the tiny recipe, over seeds: one table and one PNG.

    python examples/tiny_cpu/ablations.py --jobs 2 --threads 1             # every group, seeds 1 2 3
    python examples/tiny_cpu/ablations.py --groups veto --seeds 1          # one group, one seed
    python examples/tiny_cpu/ablations.py --report-only                    # re-read finished runs

Groups (each variant is the recipe, `run.py`, with a few flags changed):
  control    the dense control: no compression, the same `mis` correction. In fp32 the sampler is the learner, so
             its rejection rate is the floor the others are read against (every mask or veto there is numeric).
  veto       `mis` with the sequence veto at 1e-5, 1e-4 (the paper's and mis's), 1e-3.
  budget     `mis` with the KV budget at 16 (below the recipe's 20: a budget too small), and at 1/4, 1/2 and 1 x the
             mean response length (~48 tokens here; the recipe's 20 is ~0.4), buffer 2.
  rejection  at 1/4 of the mean response length (the largest mismatch): token masking (`mis`), sequence rejection
             (verl's `decoupled_seq_is_rs`: sequence weights, reject outside [0.5, 2]), geometric rejection (verl's
             `decoupled_geo_rs`: geometric mean within 0.1 %), and no correction.
Each (variant, seed) is an ordinary run directory under --out (rerunning resumes / re-reads), run by compare.py's
`run_one`. The table: accuracies at the end (greedy, 128 held-out prompts, dense and under the run's compression),
means over all rollouts of the rejection and mismatch statistics (mean [min, max] over seeds).
"""
from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import compare  # noqa: E402  (run_one, spread)
import run  # noqa: E402  (the recipe, its variants)

from slime_sparse.tasks.assets import build_assets  # noqa: E402
from slime_sparse.utils.logging import read_metrics  # noqa: E402

MEAN_RESPONSE_LEN = 48  # tokens: the recipe's mean response length over 20 rollouts (34 at the start, ~54 at the end)
QUARTER, HALF, WHOLE = MEAN_RESPONSE_LEN // 4, MEAN_RESPONSE_LEN // 2, MEAN_RESPONSE_LEN

# group -> variant -> (run.py variant, flags after it)
ABLATIONS: dict[str, dict[str, tuple[str, list[str]]]] = {
    "control": {
        "dense + mis": ("dense", ["--correction-preset", "mis"]),
    },
    "veto": {
        "veto 1e-5": ("sparse_rl", ["--correction-seq-veto", "1e-5"]),
        "veto 1e-4 (mis)": ("sparse_rl", []),
        "veto 1e-3": ("sparse_rl", ["--correction-seq-veto", "1e-3"]),
    },
    "budget": {
        # below the recipe's 20: more than half of the KV tokens saved, but ~1/6 of the sequences rejected (#45)
        "budget 16 (too small)": ("sparse_rl", ["--kv-budget", "16"]),
        f"budget {QUARTER} (1/4)": ("sparse_rl", ["--kv-budget", str(QUARTER)]),
        f"budget {HALF} (1/2)": ("sparse_rl", ["--kv-budget", str(HALF)]),
        f"budget {WHOLE} (1)": ("sparse_rl", ["--kv-budget", str(WHOLE)]),
    },
    "rejection": {
        f"token mask (mis), B={QUARTER}": ("sparse_rl", ["--kv-budget", str(QUARTER)]),
        f"sequence (decoupled_seq_is_rs), B={QUARTER}": (
            "sparse_rl", ["--kv-budget", str(QUARTER), "--correction-preset", "decoupled_seq_is_rs"]),
        f"geometric (decoupled_geo_rs), B={QUARTER}": (
            "sparse_rl", ["--kv-budget", str(QUARTER), "--correction-preset", "decoupled_geo_rs"]),
        f"none, B={QUARTER}": ("naive_sparse", ["--kv-budget", str(QUARTER)]),
    },
}
# flags every ablation run adds to the recipe (its 12 rollouts, evaluations at 0, 6 and 12)
COMMON: list[str] = []

# (label, metrics.jsonl key, how it is read, format): "end" the last evaluation, "mean" the mean over rollouts
COLUMNS = (
    ("dense acc.", "eval_dense/pass@1", "end", ".3f"),
    ("sparse acc.", "eval_sparse/pass@1", "end", ".3f"),
    ("seq. rejected", "correction/seq_reject_rate", "mean", ".3f"),
    ("tokens rejected", "correction/token_reject_rate", "mean", ".3f"),
    ("vetoed", "correction/veto_seq_frac", "mean", ".3f"),
    ("k3", "mismatch/k3", "mean", ".3f"),
    ("xi p5", "mismatch/xi_p5", "mean", ".3f"),
    ("numeric k3", "mismatch/numeric/k3", "mean", ".0e"),
    ("IS ESS", "correction/is_ess", "mean", ".3f"),
    ("KV saved", "kv/savings", "mean", ".2f"),
)


def variant_runs(groups: list[str], seeds: list[int], out: str) -> dict[str, tuple[str, list[str], list[str]]]:
    """variant -> (run.py variant, its flags, run dirs by seed), each variant once (a group may share one)."""
    runs: dict[str, tuple[str, list[str], list[str]]] = {}
    for group in groups:
        for name, (base, flags) in ABLATIONS[group].items():
            key = " ".join([base, *flags])
            slug = key.replace(" ", "_").replace("--", "").replace("/", "-") or base
            runs[name] = (base, flags, [os.path.join(out, f"{slug}-seed{s}") for s in seeds])
    return runs


def read_value(run_dir: str, key: str, how: str) -> float | None:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    records = read_metrics(path)
    if how == "end":
        evals = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        return max(evals)[1] if evals else None
    values = [r[key] for r in records if "rollout/reward_mean" in r and r.get(key) is not None]
    return sum(values) / len(values) if values else None


def table(groups: list[str], runs: dict) -> str:
    """The markdown table: one row per variant, mean [min, max] over the seeds that finished."""
    head = "| group | variant | seeds | " + " | ".join(c[0] for c in COLUMNS) + " |"
    lines = [head, "| " + " | ".join(["---"] * (3 + len(COLUMNS))) + " |"]
    for group in groups:
        for name in ABLATIONS[group]:
            dirs = runs[name][2]
            cells = []
            seeds = 0
            for _, key, how, fmt in COLUMNS:
                values = [v for v in (read_value(d, key, how) for d in dirs) if v is not None]
                seeds = max(seeds, len(values))
                cells.append(compare.spread(values, fmt) if values else "-")
            lines.append(f"| {group} | {name} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(groups: list[str], runs: dict, path: str) -> str:
    """Per group, per variant: sequence rejection rate over rollouts (mean over seeds) and end accuracies."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * len(groups), 7.0), layout="constrained")
    axes = fig.subplots(2, len(groups), squeeze=False)
    for col, group in enumerate(groups):
        top, bottom = axes[0][col], axes[1][col]
        names = list(ABLATIONS[group])
        for i, name in enumerate(names):
            curves = []
            for d in runs[name][2]:
                if os.path.exists(os.path.join(d, "metrics.jsonl")):
                    rows = [r for r in read_metrics(d) if "rollout/reward_mean" in r]
                    curves.append([r.get("correction/seq_reject_rate") or 0.0 for r in rows])
            if curves:
                n = min(map(len, curves))
                mean = [sum(c[t] for c in curves) / len(curves) for t in range(n)]
                top.plot(range(1, n + 1), mean, color=f"C{i}", label=name)
                top.fill_between(range(1, n + 1), [min(c[t] for c in curves) for t in range(n)],
                                 [max(c[t] for c in curves) for t in range(n)], color=f"C{i}", alpha=0.2)
            for j, (mode, key) in enumerate((("dense", "eval_dense/pass@1"), ("sparse", "eval_sparse/pass@1"))):
                values = [v for v in (read_value(d, key, "end") for d in runs[name][2]) if v is not None]
                if values:
                    x = i + (j - 0.5) * 0.38
                    bottom.bar(x, sum(values) / len(values), width=0.36, color=f"C{i}", alpha=1.0 if j == 0 else 0.5,
                               label=None)
                    bottom.errorbar(x, sum(values) / len(values), yerr=[[sum(values) / len(values) - min(values)],
                                                                        [max(values) - sum(values) / len(values)]],
                                    color="k", capsize=2, lw=0.8)
        top.set_title(f"{group}: sequences rejected")
        top.set_xlabel("rollout")
        top.grid(True, alpha=0.3)
        top.legend(fontsize="x-small", loc="best")
        bottom.set_title(f"{group}: greedy accuracy at the end\n(dark: dense, light: compressed inference)",
                         fontsize="small")
        bottom.set_xticks(range(len(names)), [n.split(",")[0] for n in names], rotation=20, fontsize="x-small")
        bottom.set_ylim(0, 1)
        bottom.grid(True, axis="y", alpha=0.3)
    FigureCanvasAgg(fig)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", nargs="+", choices=list(ABLATIONS), default=list(ABLATIONS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--out", default="runs/tiny_cpu_ablations")
    parser.add_argument("--plot", default=os.path.join(HERE, "ablations.png"))
    parser.add_argument("--cache-dir", default=".cache/tiny_assets")
    parser.add_argument("--report-only", action="store_true", help="only read the runs that exist")
    args = parser.parse_args(argv)

    runs = variant_runs(args.groups, args.seeds, args.out)
    if not args.report_only:
        build_assets(args.cache_dir, run.ASSETS)
        # seed-major, so a study cut short has every variant on its first seeds
        todo = list({dirs[k]: (base, seed, dirs[k], flags) for k, seed in enumerate(args.seeds)
                     for base, flags, dirs in runs.values()}.values())  # a run two groups share runs once
        print(f"{len(todo)} runs, {args.jobs} at a time; logs: <run dir>.log", flush=True)

        def one(item: tuple[str, int, str, list[str]]) -> int:
            base, seed, run_dir, flags = item
            return compare.run_one(base, seed, run_dir, args.cache_dir, [*COMMON, *flags, *extra], args.threads)

        if args.jobs == 1:  # in this thread: a run in this process (the tests) installs signal handlers
            codes = [one(item) for item in todo]
        else:
            with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                codes = list(pool.map(one, todo))
        failed = [t[2] for t, rc in zip(todo, codes) if rc]
        if failed:
            print(f"failed runs (see their .log): {', '.join(failed)}", file=sys.stderr)
    print(table(args.groups, runs))
    print(f"\nplot: {plot(args.groups, runs, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
