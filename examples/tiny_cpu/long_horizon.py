"""Where the correction matters: the long-horizon study (dense, naive sparse, Sparse-RL, SMD) on long answers.

    python examples/tiny_cpu/long_horizon.py cell --variant naive_sparse --budget quarter --seed 1   # one cell
    python examples/tiny_cpu/long_horizon.py grid --jobs 1         # every cell, one after another
    python examples/tiny_cpu/long_horizon.py report                # the tables and the plot from what has run
    python examples/tiny_cpu/long_horizon.py parts                 # + each cell's latest model's answers, by part
    python examples/tiny_cpu/long_horizon.py grid --assets-seeds 1 2 3 --variants dense naive_sparse --seeds 1
                                                                   # other data + warm starts (one each per seed)

The task (slime_sparse/tasks/long_recall.py): four keys in the prompt, a worked countdown of 312-390 tokens, then
the total and the keys again; a bare answer restates the keys at once and guesses the total. The warm start
imitates both, so GRPO has a choice to learn; the keys sit ~350 tokens behind the end of a worked answer, where
an R-KV cache of 1/4 or 1/2 of the answer drops what nothing attended to. The reward gives partial credit
(0.4 for the total, 0.6 x the fraction of the keys right).

A cell is one (variant, budget, seed, assets seed): an ordinary run directory `<out>/<budget>/<variant>-seed<seed>`
(`<out>/assets<S>/<budget>/...` for the data and warm start of assets seed S != 0; rerunning its command resumes
from the last checkpoint; a finished cell does nothing), with the CPU and wall time of each invocation appended to
`cell_time.jsonl`. Every sparse cell runs the drift guard (on by default: it probes 16 held-out prompts x 4 samples
densely and under the cell's R-KV every 10 rollouts); `sparse_rl_drift` is `mis` with the budget that adapts
(--kv-budget-schedule drift). `grid` runs the cells that are not complete, seed-major (a grid cut short has every
variant on its first seeds), each in its own process with one torch thread; `report` reads every cell that has
metrics (finished or not) and prints the tables (`long_horizon_report.py`) and one PNG; `parts` first writes
parts.json into each cell: its latest model's greedy answers, dense and under its budget's R-KV, split into worked
or bare, total right and keys right (what the compressed cache changes at the end). The dense variant trains on
dense rollouts, so its budget only sets its sparse evaluation.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import long_horizon_drift as drift  # noqa: E402  (the drift guard's tables)
import long_horizon_report as report  # noqa: E402  (aggregation, table, plot)
import run  # noqa: E402  (the variants' flags)

from slime_sparse.tasks.assets import AssetsConfig, build_assets  # noqa: E402
from slime_sparse.tasks.long_recall import LongRecallConfig  # noqa: E402
from slime_sparse.tasks.warm_start import WarmStartConfig  # noqa: E402

# The tiny Qwen2 of the recipe (~0.6M parameters), warm-started on worked and bare answers half and half.
ASSETS = AssetsConfig(task=LongRecallConfig(), warm_start=WarmStartConfig(steps=2500, batch_size=16),
                      direct_answer_frac=0.5, n_train=20000, n_test=256)
MEAN_ANSWER = 351  # tokens of a worked answer, mean over the task's range (312-390)
# R-KV budget B (+ buffer 16, window 8): 1/4 and 1/2 of the answer
BUDGETS = {"quarter": MEAN_ANSWER // 4, "half": MEAN_ANSWER // 2}
VARIANTS = ["dense", "naive_sparse", "sparse_rl", "sparse_rl_paper", "smd"]  # rows of run.VARIANTS
SEEDS = [1, 2, 3]
# the study's own rows besides run.VARIANTS': `mis` with the budget the drift guard adapts (#44)
STUDY_VARIANTS = {"sparse_rl_drift": [*run.VARIANTS["sparse_rl"], "--kv-budget-schedule", "drift"]}
ALL_VARIANTS = {**run.VARIANTS, **STUDY_VARIANTS}


def assets_config(seed: int) -> AssetsConfig:
    """The study's assets with data, initial weights and warm start all from `seed` (0: the study's default)."""
    if seed == 0:
        return ASSETS
    return dataclasses.replace(ASSETS, seed=seed, warm_start=dataclasses.replace(ASSETS.warm_start, seed=seed))


# 8 prompts x 4 samples per rollout, 2 optimizer steps; evaluation (greedy, 128 held-out prompts, dense and
# under the run's R-KV) every 10 rollouts, on the weights the drift guard probes next (before rollouts 11, 21,
# ...); the mismatch split into its sparsity and numeric parts every 10.
RECIPE = [
    "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
    "--rollout-max-response-len", "440", "--rollout-temperature", "1.0", "--rollout-max-batch-size", "64",
    "--kv-buffer", "16", "--kv-window", "8",
    "--lr", "3e-5", "--weight-decay", "0.0", "--adam-beta2", "0.98", "--clip-grad", "1.0",
    "--eps-clip", "0.2", "--use-kl-loss", "--kl-loss-coef", "1e-4", "--kl-loss-type", "k3",
    "--num-rollout", "150", "--eval-interval", "10", "--save-interval", "5", "--mismatch-metrics-interval", "10",
    "--n-samples-per-eval-prompt", "1", "--eval-max-prompts", "128", "--rm-num-workers", "0",
    "--custom-rm-path", "slime_sparse.tasks.long_recall:task_reward", "--no-progress-bar", "--no-use-tensorboard",
]


def cell_dir(out: str, variant: str, budget: str, seed: int, assets_seed: int = 0) -> str:
    return os.path.join(out, *([f"assets{assets_seed}"] if assets_seed else []), budget, f"{variant}-seed{seed}")


def run_cell(variant: str, budget: str, seed: int, out: str, cache_dir: str, extra: list[str],
             assets_seed: int = 0) -> int:
    """Train (or resume) one cell in this process; its CPU and wall time go to <run dir>/cell_time.jsonl."""
    import torch

    from slime_sparse.train import main as train_main

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # one thread unless told otherwise
    run_dir = cell_dir(out, variant, budget, seed, assets_seed)
    t0, c0 = time.perf_counter(), time.process_time()
    assets = build_assets(cache_dir, assets_config(assets_seed))
    start = report.last_step(run_dir)
    rc = train_main([
        "--hf-checkpoint", str(assets.model_dir), "--prompt-data", str(assets.train_path),
        "--eval-prompt-data", str(assets.test_path), "--run-dir", run_dir, *RECIPE, *ALL_VARIANTS[variant],
        "--kv-budget", str(BUDGETS[budget]), "--seed", str(seed), *extra,
    ])
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "cell_time.jsonl"), "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"from_rollout": start, "to_rollout": report.last_step(run_dir), "rc": rc,
                             "wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
                             "threads": torch.get_num_threads(), "loadavg_end": os.getloadavg()[0]}) + "\n")
    return rc


def answer_parts(model_dir: str, test_path: str, kv_flags: list[str], n_prompts: int = 128) -> dict:
    """Greedy answers of a model to the first held-out prompts (the evaluation's), under the embedded engine with
    `kv_flags`, split in their parts: the fraction worked (not bare), of totals right, of keys right in the
    worked answers and in the bare ones, of full scores."""
    from slime_sparse.config_loader import load_config
    from slime_sparse.eval import eval_sampling, load_eval_sets
    from slime_sparse.factory import EngineSpec, build_engine
    from slime_sparse.tasks.long_recall import ANSWER_MARK, score
    from slime_sparse.utils.hf import load_tokenizer

    cfg = load_config(["--hf-checkpoint", model_dir, "--prompt-data", test_path, "--eval-prompt-data", test_path,
                       *RECIPE, *kv_flags, "--eval-max-prompts", str(n_prompts)])
    tokenizer = load_tokenizer(model_dir)
    records = load_eval_sets(cfg, tokenizer)[""]
    outputs = build_engine(EngineSpec.from_run(cfg)).generate([r.prompt_ids for r in records], eval_sampling(cfg),
                                                               seed=0)
    texts = tokenizer.batch_decode([o.response_ids for o in outputs], skip_special_tokens=True)
    parts = [(not t.startswith(ANSWER_MARK), *(score(t, r.label) if o.finish_reason == "stop" else (0.0, 0.0)))
             for t, o, r in zip(texts, outputs, records)]
    worked, bare = [p for p in parts if p[0]], [p for p in parts if not p[0]]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {"worked": len(worked) / len(parts), "total": mean([p[1] for p in parts]),
            "keys_worked": mean([p[2] for p in worked]), "keys_bare": mean([p[2] for p in bare]),
            "full": mean([float(p[1] == 1.0 and p[2] == 1.0) for p in parts]), "prompts": len(parts)}


def write_parts(run_dirs: dict[tuple[str, str], list[str]], cache_dir: str) -> None:
    """parts.json in every cell with a checkpoint: its latest model's answer parts, dense and under its budget's
    R-KV; <out>/[assets<S>/]<budget>/warm_start_parts.json: the warm start's."""
    from slime_sparse.utils.checkpoint import latest_checkpoint

    for (label, _), dirs in run_dirs.items():
        budget, assets_seed = parse_label(label)
        assets = build_assets(cache_dir, assets_config(assets_seed))
        sparse = ["--kv-method", "rkv", "--kv-budget", str(BUDGETS[budget])]
        targets = [(os.path.join(os.path.dirname(dirs[0]), "warm_start_parts.json"), str(assets.model_dir), 0)]
        for d in dirs:
            ckpt = latest_checkpoint(os.path.join(d, "checkpoints"))
            if ckpt is not None:
                with open(os.path.join(ckpt, "trainer_state.json"), encoding="utf-8") as fh:
                    targets.append((os.path.join(d, "parts.json"), os.path.join(ckpt, "model"), json.load(fh)["step"]))
        for path, model_dir, step in targets:
            if os.path.isfile(path) and json.load(open(path, encoding="utf-8"))["rollout"] == step:
                continue  # up to date
            out = {"rollout": step, "dense": answer_parts(model_dir, str(assets.test_path), ["--kv-method", "none"]),
                   "sparse": answer_parts(model_dir, str(assets.test_path), sparse)}
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(out, fh, indent=1)
            print(f"{path}: rollout {step}", flush=True)


def label(budget: str, assets_seed: int) -> str:
    """A table row's budget column: the budget, and the assets seed when it is not the study's default."""
    return budget if not assets_seed else f"{budget} assets{assets_seed}"


def parse_label(text: str) -> tuple[str, int]:
    budget, _, assets = text.partition(" assets")
    return budget, int(assets or 0)


Cell = tuple[str, str, int, int]  # variant, budget, seed, assets seed


def cells(variants: list[str], budgets: list[str], seeds: list[int], assets_seeds: list[int]) -> list[Cell]:
    """Seed-major order: a grid cut short has every (budget, variant) on its first seeds."""
    return [(v, b, s, a) for a in assets_seeds for s in seeds for b in budgets for v in variants]


def run_grid(todo: list[Cell], args, extra: list[str]) -> list[str]:
    """Each cell in a child process with one thread (its output in <run dir>.log); returns the failed ones."""
    def one(cell: Cell) -> int:
        variant, budget, seed, assets_seed = cell
        run_dir = cell_dir(args.out, *cell)
        os.makedirs(os.path.dirname(run_dir), exist_ok=True)
        cmd = [sys.executable, os.path.abspath(__file__), "cell", "--variant", variant, "--budget", budget,
               "--seed", str(seed), "--assets-seeds", str(assets_seed), "--out", args.out, "--cache-dir",
               args.cache_dir, "--", *extra]
        with open(run_dir + ".log", "a", encoding="utf-8") as log:
            print(f"start {run_dir}", flush=True)
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
            print(f"end {run_dir}: rc {rc}", flush=True)
            return rc

    for assets_seed in dict.fromkeys(c[3] for c in todo):  # once each, before the cells share them
        build_assets(args.cache_dir, assets_config(assets_seed))
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        codes = list(pool.map(one, todo))
    return [cell_dir(args.out, *c) for c, rc in zip(todo, codes) if rc]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # more trainer flags (they win)
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["cell", "grid", "parts", "report"])
    parser.add_argument("--variant", choices=list(ALL_VARIANTS), help="cell: the variant (a row of run.py's or "
                        "STUDY_VARIANTS)")
    parser.add_argument("--budget", choices=list(BUDGETS), help="cell: the R-KV budget")
    parser.add_argument("--seed", type=int, help="cell: the seed")
    parser.add_argument("--variants", nargs="+", choices=list(ALL_VARIANTS), default=VARIANTS)
    parser.add_argument("--budgets", nargs="+", choices=list(BUDGETS), default=["quarter", "half"])
    parser.add_argument("--seeds", nargs="+", type=int, default=SEEDS)
    parser.add_argument("--assets-seeds", nargs="+", type=int, default=[0], help=(
        "data + initial weights + warm start seeds (0: the study's; cell: the first one)"))
    parser.add_argument("--jobs", type=int, default=1, choices=[1, 2], help="grid: cells at once")
    parser.add_argument("--out", default="runs/long_horizon")
    parser.add_argument("--cache-dir", default=".cache/tiny_assets")
    parser.add_argument("--plot", default=None, help="report: PNG path (default: <out>/long_horizon.png)")
    args = parser.parse_args(argv)

    if args.command == "cell":
        missing = [f"--{k}" for k in ("variant", "budget", "seed") if getattr(args, k) is None]
        if missing:
            parser.error(f"cell needs {' '.join(missing)}")
        return run_cell(args.variant, args.budget, args.seed, args.out, args.cache_dir, extra, args.assets_seeds[0])
    grid = cells(args.variants, args.budgets, args.seeds, args.assets_seeds)
    if args.command == "grid":
        flags = [*RECIPE, *extra]
        target = int(flags[len(flags) - 1 - flags[::-1].index("--num-rollout") + 1])  # the last one wins
        todo = [c for c in grid if not report.is_complete(cell_dir(args.out, *c), target)]
        print(f"{len(todo)} of {len(grid)} cells to run, {args.jobs} at a time; logs: <run dir>.log", flush=True)
        failed = run_grid(todo, args, extra)
        if failed:
            print(f"failed cells (see their .log): {', '.join(failed)}", file=sys.stderr)
            return 1
    dirs: dict[tuple[str, str], list[str]] = {}
    for variant, budget, seed, assets_seed in grid:
        d = cell_dir(args.out, variant, budget, seed, assets_seed)
        if os.path.isfile(os.path.join(d, "metrics.jsonl")):
            dirs.setdefault((label(budget, assets_seed), variant), []).append(d)
    if not dirs:
        print(f"no cell has metrics under {args.out}", file=sys.stderr)
        return 1
    if args.command == "parts":
        write_parts(dirs, args.cache_dir)
    runs = {k: [report.load_run(d) for d in ds] for k, ds in dirs.items()}
    budgets = {key: BUDGETS[parse_label(key)[0]] for key, _ in runs}
    print(report.study_table(runs, budgets))
    print()
    print(report.events_table(runs))
    print()
    print(report.time_table(runs))
    parts = report.parts_table(runs, args.out)
    if parts:
        print()
        print(parts)
    for table in (drift.guard_table(runs), drift.separation_table(runs), drift.adaptive_table(runs)):
        if table:
            print()
            print(table)
    plot = report.plot_study(runs, budgets, args.plot or os.path.join(args.out, "long_horizon.png"))
    print(f"\nplot: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
