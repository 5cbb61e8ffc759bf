"""The study: the tiny recipe under every variant and several seeds, side by side (tables + one PNG).

    python examples/tiny_cpu/compare.py --jobs 2                          # every variant x seeds 1 2 3 (README.md)
    python examples/tiny_cpu/compare.py --jobs 2 -- --num-rollout 60      # longer runs (anything after -- : run.py's)
    python examples/tiny_cpu/compare.py --variants dense naive_sparse -- --kv-budget 8

Each (variant, seed) is one `run.py` run in its own directory under --out (rerunning resumes / re-reads
finished runs, so a longer --num-rollout extends a finished study), so the study is made of ordinary runs a
person can also plot. `--jobs N` runs N of them at once, each in its own process with cores / N threads (tiny
models use 2 cores better as 2 x 1 thread); runs go seed by seed, so a study cut short has every variant on
its first seeds. It prints the end of training per variant (mean over seeds, [min, max] across them), the
paper's claims next to what this study measured, and writes one PNG of the curves (mean line, min-max band
over seeds). A variant is a name and its extra flags: one row of run.VARIANTS.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import run  # noqa: E402  (the recipe, its variants and its summary)

from slime_sparse.tasks.assets import build_assets  # noqa: E402
from slime_sparse.utils.logging import read_metrics  # noqa: E402

Summary = list[run.Row]  # one run's summarize() rows


def spread(values: list[float], fmt: str) -> str:
    """'mean [min, max]' (just the value for one seed)."""
    if not values:
        return "n/a"
    mean = sum(values) / len(values)
    return f"{mean:{fmt}}" + (f" [{min(values):{fmt}}, {max(values):{fmt}}]" if len(values) > 1 else "")


def column(results: dict[str, list[Summary]], variant: str, label: str, end: bool = True) -> list[float]:
    """One metric (end or start value) across the seeds of a variant."""
    return [s for summary in results[variant] for (lab, start, stop, _) in summary if lab == label
            for s in [stop if end else start]]


def compare_table(results: dict[str, list[Summary]]) -> str:
    """End of training per variant, mean [min, max] over seeds; the starts (shared warm start) below."""
    variants = list(results)
    labels: dict[str, str] = {}  # label -> format, in first-seen order
    for summaries in results.values():
        for summary in summaries:
            for label, _, _, fmt in summary:
                labels.setdefault(label, fmt)
    width = 26
    lines = [f"{'metric (end of training)':<42}" + "".join(f"{v:>{width}}" for v in variants),
             "-" * (42 + width * len(variants))]
    for label, fmt in labels.items():
        lines.append(f"{label:<42}" + "".join(f"{spread(column(results, v, label), fmt):>{width}}" for v in variants))
    for label, fmt in labels.items():
        if label.startswith("eval accuracy"):
            starts = [x for v in variants for x in column(results, v, label, end=False)]
            lines.append(f"(start of training, {label.split(', ')[1]}: {spread(starts, fmt)})")
    return "\n".join(lines)


DENSE_ACC, SPARSE_ACC = "eval accuracy, dense inference (greedy)", "eval accuracy, sparse inference (greedy)"


def claims_table(results: dict[str, list[Summary]]) -> str:
    """The paper's headline claims next to this study's numbers (mean [min, max] over seeds)."""
    def ends(variant: str, label: str) -> list[float]:
        return column(results, variant, label) if variant in results else []

    def ratio(a: str, b: str, label: str) -> list[float]:  # seed-paired ratio a / b
        return [x / y for x, y in zip(ends(a, label), ends(b, label)) if y > 0]

    def gain(variant: str, label: str) -> list[float]:
        return [e - s for e, s in zip(column(results, variant, label), column(results, variant, label, end=False))] \
            if variant in results else []

    rows = [("dense GRPO learns (dense accuracy, end - start)", "(premise)", spread(gain("dense", DENSE_ACC), "+.3f"))]
    for v in [v for v in results if v != "dense"]:
        rows += [
            (f"{v}: KV tokens saved", "35-53 %", spread(ends(v, "KV token savings"), ".3f")),
            (f"{v}: dense accuracy / dense GRPO's", "~0.97", spread(ratio(v, "dense", DENSE_ACC), ".3f")),
            (f"{v}: dense accuracy, end - start", "naive sparse: falls", spread(gain(v, DENSE_ACC), "+.3f")),
            (f"{v}: sparse accuracy / dense GRPO's", "> 1 (Sparse-RL)", spread(ratio(v, "dense", SPARSE_ACC), ".3f")),
            (f"{v}: sequence rejection rate", "~0.07 (Sparse-RL)", spread(ends(v, "sequence rejection rate"), ".4f")),
        ]
    lines = [f"{'claim':<50} {'paper':>20} {'here':>28}", "-" * 100]
    lines += [f"{c:<50} {p:>20} {h:>28}" for c, p, h in rows]
    return "\n".join(lines)


def curves(run_dir: str) -> dict[str, tuple[list[int], list[float]]]:
    """The plotted series of one run: key -> (steps, values)."""
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    out = {}
    for key in ("rollout/reward_mean", "mismatch/k3"):
        pts = [(r["step"], r[key]) for r in records if r.get(key) is not None and "rollout/reward_mean" in r]
        out[key] = ([s for s, _ in pts], [v for _, v in pts])
    for mode in ("dense", "sparse"):
        series = run.eval_series(records, mode)
        out[f"eval_{mode}"] = (sorted(series), [series[s] for s in sorted(series)])
    return out


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (rollout rewards of 128 samples are noisy)."""
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]


PANELS = (("rollout/reward_mean", "rollout reward (T=1, moving avg of 5)"),
          ("eval_dense", "greedy accuracy, dense inference"),
          ("eval_sparse", "greedy accuracy, sparse inference (R-KV)"),
          ("mismatch/k3", "mismatch KL k3 (pi_old || pi_sparse)"))


def plot_study(run_dirs: dict[str, list[str]], path: str, title: str) -> str:
    """One PNG: a panel per metric, per variant the mean over seeds and a min-max band."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 7.5), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    for i, (variant, dirs) in enumerate(run_dirs.items()):
        per_seed = [curves(d) for d in dirs]
        for ax, (key, name) in zip(axes, PANELS):
            seeds = [c[key] for c in per_seed if c[key][0]]
            if not seeds:
                continue
            n = min(len(s[0]) for s in seeds)  # a run still going is cut to the common length
            steps = seeds[0][0][:n]
            vals = [smooth(v[:n], 5) if key == "rollout/reward_mean" else v[:n] for _, v in seeds]
            cols = list(zip(*vals))
            ax.plot(steps, [sum(c) / len(c) for c in cols], color=f"C{i}", label=f"{variant} ({len(seeds)} seeds)",
                    marker="." if len(steps) < 30 else None)
            ax.fill_between(steps, [min(c) for c in cols], [max(c) for c in cols], color=f"C{i}", alpha=0.2)
    for ax, (_, name) in zip(axes, PANELS):
        ax.set_title(name)
        ax.set_xlabel("rollout")
        ax.grid(True, alpha=0.3)
    axes[0].legend(loc="best", fontsize="small")
    fig.suptitle(title)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=90)
    return path


def run_one(variant: str, seed: int, run_dir: str, cache_dir: str, extra: list[str], threads: int) -> int:
    """One run.py run in a child process (its output in <run_dir>.log); returns its exit code."""
    cmd = [sys.executable, os.path.join(HERE, "run.py"), "--variant", variant, "--cache-dir", cache_dir,
           "--run-dir", run_dir, "--threads", str(threads),
           "--", "--no-progress-bar", *extra, "--seed", str(seed)]  # the last --seed wins
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    os.makedirs(os.path.dirname(os.path.abspath(run_dir)), exist_ok=True)
    with open(run_dir + ".log", "a", encoding="utf-8") as log:
        return subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", choices=list(run.VARIANTS), default=run.PAPER_VARIANTS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per run (0: cores / jobs); float sums, hence runs, depend on it")
    parser.add_argument("--out", default="runs/tiny_cpu_study")
    parser.add_argument("--plot", default=None, help="PNG path (default: <out>/study.png)")
    parser.add_argument("--cache-dir", default=".cache/tiny_assets")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.threads < 0:
        parser.error(f"--jobs={args.jobs} must be >= 1 and --threads={args.threads} >= 0")

    build_assets(args.cache_dir, run.ASSETS)  # once, before the runs share it
    # seed-major: a study cut short still has every variant on its first seeds
    runs = [(v, s, os.path.join(args.out, f"{v}-seed{s}")) for s in args.seeds for v in args.variants]
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    print(f"{len(runs)} runs, {args.jobs} at a time; logs: <run dir>.log", flush=True)
    def one(r: tuple[str, int, str]) -> int:
        return run_one(*r, args.cache_dir, extra, threads)

    if args.jobs == 1:  # in this thread: a run in this process (the tests) installs signal handlers
        codes = [one(r) for r in runs]
    else:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            codes = list(pool.map(one, runs))
    failed = [d for (_, _, d), rc in zip(runs, codes) if rc]
    if failed:
        print(f"failed runs (see their .log): {', '.join(failed)}", file=sys.stderr)
        return 1

    results = {v: [run.summarize(d)[0] for (w, _, d) in runs if w == v] for v in args.variants}
    flags = " ".join(extra) or "the recipe's defaults"
    print(f"\nTiny recipe study: {len(args.seeds)} seeds per variant ({', '.join(map(str, args.seeds))}); flags: {flags}\n")
    print(compare_table(results))
    print()
    print(claims_table(results))
    plot = plot_study({v: [d for (w, _, d) in runs if w == v] for v in args.variants},
                      args.plot or os.path.join(args.out, "study.png"),
                      f"tiny recipe, seeds {', '.join(map(str, args.seeds))} (mean, min-max band); {flags}")
    print(f"\nplot: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
