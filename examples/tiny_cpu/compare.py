"""Run the tiny recipe under several variants and seeds and print them side by side.

    python examples/tiny_cpu/compare.py                                  # sparse_rl, naive_sparse, dense x seeds 1, 2
    python examples/tiny_cpu/compare.py --variants sparse_rl naive_sparse --seeds 1 2 3 -- --lr 1e-4

Each (variant, seed) is one `run.py` run in its own directory under --out (rerunning resumes / re-reads
finished runs), so the comparison is made of ordinary runs a person can also plot. The table gives, per
variant, the mean over seeds of each metric at the end of training, with the min-max spread across seeds
(this task is small: differences inside the spread are noise).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run  # noqa: E402  (the recipe, its variants and its summary)


def compare_table(results: dict[str, list[list[tuple[str, float, float, str]]]]) -> str:
    """results[variant] = one summarize() metric list per seed -> a table of end values (mean [min, max])."""
    variants = list(results)
    by_label = {v: [{label: (start, end) for label, start, end, _ in seed} for seed in seeds]
                for v, seeds in results.items()}
    labels: dict[str, str] = {}  # label -> format, in first-seen order
    for seeds in results.values():
        for seed in seeds:
            for label, _, _, fmt in seed:
                labels.setdefault(label, fmt)
    width = 28
    lines = [f"{'metric (end of training)':<40}" + "".join(f"{v:>{width}}" for v in variants),
             "-" * (40 + width * len(variants))]
    for label, fmt in labels.items():
        cells = []
        for v in variants:
            ends = [seed[label][1] for seed in by_label[v] if label in seed]
            if not ends:
                cells.append("n/a")
                continue
            spread = f" [{min(ends):{fmt}},{max(ends):{fmt}}]" if len(ends) > 1 else ""
            cells.append(f"{sum(ends) / len(ends):{fmt}}{spread}")
        lines.append(f"{label:<40}" + "".join(f"{c:>{width}}" for c in cells))
    for label, fmt in labels.items():  # every variant starts from the same warm start
        if label.startswith("eval accuracy"):
            starts = [seed[label][0] for v in variants for seed in by_label[v] if label in seed]
            lines.append(f"(start of training, {label.split(', ')[1]}: {sum(starts) / len(starts):{fmt}})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--"):] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", choices=sorted(run.VARIANTS),
                        default=["sparse_rl", "naive_sparse", "dense"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--out", default="runs/tiny_cpu_compare")
    parser.add_argument("--cache-dir", default=".cache/tiny_assets")
    args = parser.parse_args(argv)

    results: dict[str, list] = {}
    for variant in args.variants:
        for seed in args.seeds:
            run_dir = os.path.join(args.out, f"{variant}-seed{seed}")
            print(f"=== {variant}, seed {seed}: {run_dir}", flush=True)
            seed_args = ["--", *(extra[1:] if extra else []), "--seed", str(seed)]  # the last --seed wins
            rc = run.main(["--variant", variant, "--cache-dir", args.cache_dir, "--run-dir", run_dir, *seed_args])
            if rc:
                return rc
            results.setdefault(variant, []).append(run.summarize(run_dir)[0])
    print(f"\nTiny recipe, {len(args.seeds)} seed(s) per variant ({', '.join(map(str, args.seeds))})\n")
    print(compare_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
