"""Regenerate every number the READMEs state about the tiny recipe, on the current code, in one command.

    python examples/tiny_cpu/reproduce.py                      # the main job's numbers (~10 min on 2 idle cores)
    python examples/tiny_cpu/reproduce.py --parts all --jobs 2 # + the studies and the ablations (hours)
    python examples/tiny_cpu/reproduce.py --check              # the drift check only: the main job against the README

Each part runs ordinary runs (run.py, compare.py, ablations.py) under --out and writes what they print into the READMEs
between `<!-- reproduce:NAME -->` markers, with the command, the machine, the date and the commit; nothing else in the
READMEs changes. Parts:

  main        the main job exactly as a user runs it (`python examples/tiny_cpu/run.py`, assets built from nothing),
              its table, wall and CPU times; then seeds 2 and 3 and the dense variant beside it (--jobs at a time)
  study       compare.py: the paper's four variants x seeds 1 2 3, 20 rollouts, and the three other rows
  study100    compare.py: the paper's four variants x seeds 1 2 3, 100 rollouts
  ablations   ablations.py: 10 variants x seeds 1 2 3, 20 rollouts

What reproduces how: on the same machine type (CPU model and torch build: `fingerprint`; run.py trains on one thread,
so the core count does not matter) every digit. Elsewhere
the warm start's float sums differ and its 600 steps at lr 3e-3 amplify the rounding into another starting model, so
only the rows in ROBUST hold, within their tolerance (tests/test_readme_numbers.py checks both, `pytest -m slow`).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, ROOT]  # this checkout's code, whatever an install points at

import run  # noqa: E402  (the recipe and its summary table)

TINY_README = os.path.join(HERE, "README.md")
MAIN_README = os.path.join(ROOT, "README.md")
PARTS = ("main", "study", "study100", "ablations")
MAIN_SEEDS = (1, 2, 3)

# Rows of the main job's table that hold on any machine (label -> (which end, tolerance)): the end of training is
# steadier than its start, and the KV accounting follows from the budget alone. Measured across three float paths
# of the warm start (1 or 2 threads, whole or micro-batched batches): dense accuracy ended at 0.945-0.977 from starts
# of 0.133-0.328; savings 0.47-0.50.
ROBUST = {
    "eval accuracy, dense inference (greedy)": ("end", 0.06),
    "KV token savings": ("end", 0.04),
    "peak KV tokens per sequence": ("end", 0.0),
}


# ---------------------------------------------------------------------------------------------------- the machine
def machine() -> dict[str, str]:
    """What a number was measured on: CPU model, cores, torch, the date (UTC), the commit, the load."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": str(os.cpu_count()), "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "commit": commit(),
            "load": " ".join(f"{x:.1f}" for x in os.getloadavg())}


def fingerprint(m: dict[str, str]) -> str:
    """Where the main job's digits reproduce exactly: the same CPU model and torch build (one thread: any cores)."""
    return f"{m['cpu']}, torch {m['torch']}"


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ------------------------------------------------------------------------------------------------ README blocks
def block_pattern(name: str) -> re.Pattern:
    """A block on lines of its own (`<!-- reproduce:NAME -->` NEWLINE ... `<!-- /reproduce:NAME -->`) or inline."""
    return re.compile(rf"(<!-- reproduce:{re.escape(name)} -->\n?)(.*?)(<!-- /reproduce:{re.escape(name)} -->)", re.S)


def read_block(text: str, name: str) -> str:
    match = block_pattern(name).search(text)
    if match is None:
        raise ValueError(f"no <!-- reproduce:{name} --> block")
    return match.group(2)


def write_block(path: str, name: str, content: str) -> None:
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if block_pattern(name).search(text) is None:
        raise ValueError(f"{path} has no <!-- reproduce:{name} --> block to fill")
    text = block_pattern(name).sub(
        lambda m: m.group(1) + content.rstrip("\n") + ("\n" if m.group(1).endswith("\n") else "") + m.group(3), text)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def parse_table(table: str) -> dict[str, tuple[float, float]]:
    """label -> (start, end) of a main-job table as `run.summary_table` prints it."""
    rows = {}
    for line in table.splitlines():
        match = re.match(r"^(.{42}) +(-?[\d.]+) +(-?[\d.]+)", line)
        if match and not line.startswith("metric"):
            rows[match.group(1).strip()] = (float(match.group(2)), float(match.group(3)))
    return rows


def drift(readme_table: str, fresh_table: str, exact: bool) -> list[str]:
    """What differs between the README's main-job table and a fresh one: every character on the same machine type,
    else the ROBUST rows beyond their tolerance."""
    if exact:
        old, new = readme_table.strip().splitlines(), fresh_table.strip().splitlines()
        return [f"README: {a!r}\nfresh:  {b!r}" for a, b in zip(old, new) if a != b] + \
            ([f"{len(old)} lines in the README, {len(new)} fresh"] if len(old) != len(new) else [])
    old, new = parse_table(readme_table), parse_table(fresh_table)
    out = []
    for label, (end, tol) in ROBUST.items():
        a, b = old[label][end == "end"], new[label][end == "end"]
        if abs(a - b) > tol + 1e-9:
            out.append(f"{label}: README {a} vs fresh {b} (tolerance {tol})")
    return out


# ------------------------------------------------------------------------------------------------------ runs
def run_job(args: list[str], log_path: str, threads: int | None = None) -> tuple[int, float, float]:
    """A child process (output to log_path); returns (exit code, wall s, CPU s of it and its children)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        rc = subprocess.call([sys.executable, *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return rc, time.perf_counter() - start, cpu


def main_job(out: str, variant: str = "sparse_rl", seed: int = 1, cache_dir: str | None = None) -> dict:
    """One run.py run as a user starts it, in out/<variant>-seed<seed>, from scratch; its table and times.
    cache_dir: where the assets are (built if missing; default the user's .cache/tiny_assets)."""
    run_dir = os.path.join(out, f"{variant}-seed{seed}")
    cache = cache_dir or os.path.join(ROOT, ".cache", "tiny_assets")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    argv = [os.path.join(HERE, "run.py"), "--variant", variant, "--cache-dir", cache, "--run-dir", run_dir]
    if seed != 1:
        argv += ["--", "--seed", str(seed)]
    rc, wall, cpu = run_job(argv, run_dir + ".log")
    if rc:
        raise SystemExit(f"{' '.join(argv)} failed (exit {rc}): see {run_dir}.log")
    with open(run_dir + ".log", encoding="utf-8") as fh:
        log = fh.read()
    assets = re.search(r"assets ready in (\d+)s \((\d+)s CPU", log)
    return {"run_dir": run_dir, "table": run.summary_table(run_dir), "wall": wall, "cpu": cpu,
            "assets_wall": float(assets.group(1)) if assets else None,
            "assets_cpu": float(assets.group(2)) if assets else None}


def stamp(m: dict[str, str], command: str) -> str:
    return (f"Regenerated by `{command}` on {m['date']} at commit {m['commit']}: {fingerprint(m)}, "
            f"load average {m['load']} at the start.")


def part_main(out: str, m: dict[str, str], jobs: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    cache = os.path.join(out, "fresh_assets")  # the user's first run builds the assets from nothing
    shutil.rmtree(cache, ignore_errors=True)
    first = main_job(out, cache_dir=cache)  # alone: its time is the one the READMEs quote
    others = [("sparse_rl", s) for s in MAIN_SEEDS[1:]] + [("dense", 1)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = list(pool.map(lambda vs: main_job(out, variant=vs[0], seed=vs[1], cache_dir=cache), others))
    seeds = {1: first} | {s: r for (v, s), r in zip(others, done) if v == "sparse_rl"}
    dense = done[-1]
    write_block(TINY_README, "main-table", "```\n" + first["table"] + "\n```")
    dense_acc = "eval accuracy, dense inference (greedy)"
    sparse_acc = "eval accuracy, sparse inference (greedy)"
    rows = {s: parse_table(r["table"]) for s, r in seeds.items()}
    dense_rows = parse_table(dense["table"])
    per_seed = "; ".join(f"seed {s}: {rows[s][dense_acc][0]:.3f} -> {rows[s][dense_acc][1]:.3f} dense, "
                         f"{rows[s][sparse_acc][0]:.3f} -> {rows[s][sparse_acc][1]:.3f} sparse" for s in MAIN_SEEDS)
    savings = [rows[s]["KV token savings"][1] for s in MAIN_SEEDS]
    rejected = [rows[s]["sequence rejection rate"][1] for s in MAIN_SEEDS]
    k3 = [rows[s]["mismatch KL k3 (pi_old || pi_sparse)"][1] for s in MAIN_SEEDS]
    write_block(TINY_README, "main-seeds", (
        f"Greedy accuracy over the 128 held-out prompts, start -> end of the 20 rollouts, {per_seed} "
        f"(`-- --seed N`); dense GRPO (`--variant dense`, seed 1): {dense_rows[dense_acc][0]:.3f} -> "
        f"{dense_rows[dense_acc][1]:.3f}. Over the last 5 rollouts of seeds 1-3: KV tokens kept out of memory "
        f"{min(savings):.3f}-{max(savings):.3f}, sequences `mis` rejects {min(rejected):.3f}-{max(rejected):.3f} "
        f"(the paper reports ~0.07), mismatch k3 {min(k3):.3f}-{max(k3):.3f} nats per token."))
    write_block(TINY_README, "main-time", (
        f"Time of the first run (assets built from nothing, one thread): **{first['wall']:.0f} s wall**, "
        f"{first['cpu']:.0f} s CPU; the assets (warm start, on one thread) {first['assets_wall']:.0f} s wall, "
        f"{first['assets_cpu']:.0f} s CPU. {stamp(m, 'python examples/tiny_cpu/reproduce.py')} On a loaded machine "
        "the wall time grows and the CPU time stays."))
    write_block(MAIN_README, "headline", (
        f"dense GRPO and Sparse-RL both raise greedy accuracy (dense inference) from "
        f"{dense_rows[dense_acc][0]:.2f} to {dense_rows[dense_acc][1]:.2f} and {rows[1][dense_acc][1]:.2f} on seed 1 "
        f"while R-KV keeps {100 * rows[1]['KV token savings'][1]:.0f} % of the KV tokens out of memory"))
    write_block(MAIN_README, "main-time", (
        f"{first['cpu'] / 60:.1f} minutes of CPU time ({first['wall'] / 60:.1f} minutes of wall time on {m['cores']} "
        f"cores at load average {m['load'].split()[0]}, {m['date']})"))


def part_study(out: str, m: dict[str, str], num_rollout: int, jobs: int) -> None:
    import compare

    name = "study" if num_rollout == 20 else "study100"
    variants = run.PAPER_VARIANTS + (["sparse_rl_ds", "shadow", "smd"] if num_rollout == 20 else [])
    study_dir = os.path.join(out, f"study_{num_rollout}")
    flags = [] if num_rollout == 20 else ["--", "--num-rollout", "100", "--eval-interval", "10",
                                          "--save-interval", "10"]
    png = "study_20_rollouts.png" if num_rollout == 20 else "study.png"
    argv = [os.path.join(HERE, "compare.py"), "--jobs", str(jobs), "--threads", "1", "--out", study_dir,
            "--variants", *variants, "--plot", os.path.join(HERE, png), *flags]
    rc, wall, _ = run_job(argv, os.path.join(out, f"{name}.log"))
    if rc:
        raise SystemExit(f"compare.py failed (exit {rc}): see {out}/{name}.log")
    dirs = {v: [os.path.join(study_dir, f"{v}-seed{s}") for s in MAIN_SEEDS] for v in variants}
    results = {v: [run.summarize(d)[0] for d in ds] for v, ds in dirs.items()}
    command = f"python examples/tiny_cpu/reproduce.py --parts {name} --jobs {jobs}"
    write_block(TINY_README, name, "\n".join([
        "```", compare.compare_table(results), "```", "", "```", compare.claims_table(results), "```", "",
        over_time_table(dirs, num_rollout), "",
        f"{len(variants) * len(MAIN_SEEDS)} runs in {wall / 60:.0f} minutes (`--jobs {jobs} --threads 1`). "
        + stamp(m, command)]))


def over_time_table(dirs: dict[str, list[str]], num_rollout: int) -> str:
    """Per variant, mean over seeds: greedy accuracies at 1/10, 1/2 and the end; k3 and sequences rejected over the
    rollouts around those points (the first tenth, the tenth around the middle, the last tenth)."""
    from slime_sparse.utils.logging import read_metrics

    marks = [num_rollout // 10, num_rollout // 2, num_rollout]
    tenth = max(1, num_rollout // 10)
    spans = [(1, tenth), (num_rollout // 2 - tenth // 2 + 1, num_rollout // 2 + tenth - tenth // 2),
             (num_rollout - tenth + 1, num_rollout)]
    lines = [f"| variant | dense greedy acc. at {' / '.join(map(str, marks))} | sparse greedy acc. at "
             f"{' / '.join(map(str, marks))} | k3 (nats/token), rollouts {' / '.join(f'{a}-{b}' for a, b in spans)} "
             "| sequences rejected |", "| --- | --- | --- | --- | --- |"]
    for variant, run_dirs in dirs.items():
        records = [read_metrics(os.path.join(d, "metrics.jsonl")) for d in run_dirs]

        def mean(xs):
            xs = [x for x in xs if x is not None]
            return sum(xs) / len(xs) if xs else float("nan")

        def at(mode):
            return " / ".join(f"{mean([run.eval_series(r, mode).get(s) for r in records]):.3f}" for s in marks)

        def over(key):
            rows = [[x for r in records for x in r if "rollout/reward_mean" in x and a <= x["step"] <= b]
                    for a, b in spans]
            return " / ".join(f"{mean([x.get(key) for x in span]):.3f}" for span in rows)
        lines.append(f"| {variant} | {at('dense')} | {at('sparse')} | {over('mismatch/k3')} | "
                     f"{over('correction/seq_reject_rate')} |")
    return "\n".join(lines)


def part_ablations(out: str, m: dict[str, str], jobs: int) -> None:
    import ablations

    abl_dir = os.path.join(out, "ablations")
    argv = [os.path.join(HERE, "ablations.py"), "--jobs", str(jobs), "--threads", "1", "--out", abl_dir]
    rc, wall, _ = run_job(argv, os.path.join(out, "ablations.log"))
    if rc:
        raise SystemExit(f"ablations.py failed (exit {rc}): see {out}/ablations.log")
    groups = list(ablations.ABLATIONS)
    runs = ablations.variant_runs(groups, list(MAIN_SEEDS), abl_dir)
    write_block(TINY_README, "ablations", "\n".join([
        ablations.table(groups, runs), "",
        f"{len({d for _, _, ds in runs.values() for d in ds})} runs in {wall / 60:.0f} minutes "
        f"(`--jobs {jobs} --threads 1`). " + stamp(m, f"python examples/tiny_cpu/reproduce.py --parts ablations "
                                                    f"--jobs {jobs}")]))


def check(out: str) -> list[str]:
    """The drift check: the main job now against the README's table (exact on the README's machine type)."""
    with open(TINY_README, encoding="utf-8") as fh:
        text = fh.read()
    readme_table = read_block(text, "main-table").strip().strip("`").strip()
    same = fingerprint(machine()) in read_block(text, "main-time")
    fresh = main_job(out)["table"]
    return drift(readme_table, fresh, exact=same)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=[*PARTS, "all"], default=["main"])
    parser.add_argument("--jobs", type=int, default=2, help="runs at once after the first (each on one thread)")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "reproduce"))
    parser.add_argument("--check", action="store_true", help="only compare the main job with the README's table")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.out)
        print("\n".join(problems) if problems else "the main job's table matches the README's")
        return 1 if problems else 0
    parts = PARTS if "all" in args.parts else args.parts
    m = machine()
    for part in parts:
        print(f"{part}: running (logs under {args.out})", flush=True)
        if part == "main":
            part_main(args.out, m, args.jobs)
        elif part in ("study", "study100"):
            part_study(args.out, m, 20 if part == "study" else 100, args.jobs)
        else:
            part_ablations(args.out, m, args.jobs)
        print(f"{part}: written into the READMEs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
