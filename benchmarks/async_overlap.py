"""What overlapping rollouts with training buys (#47): measured on CPU through Ray, and by arithmetic on a cluster.

    python benchmarks/async_overlap.py ray --num-rollout 6          # the tiny recipe on Ray, 1 learner + 2 engines:
                                                                      # sync vs --async at the same samples
    python benchmarks/async_overlap.py arithmetic --steps-file S    # sync vs async step time at rl_step_bench.py's
                                                                      # phases (its --out file; none: the CPU tiny run)

`ray`: the tiny recipe (examples/tiny_cpu, its warm-started model) with its learner as one Ray actor and two engine
actors, once synchronous and once with --async (and --partial-rollout with --async if asked), same seed and samples.
Per mode: the wall time per rollout (median of the gaps between consecutive metrics lines, the first rollout left out:
it carries Ray's start), the phases each rollout logged (rollout, recompute, train, sync; --async: the time the
learner waited for the rollout thread and for the drain before an update), and under --async the staleness of the
trained samples (samples.jsonl). The CPU is shared (engines and learner run on the same cores as everything else on
the machine): the load average is printed beside the table; compare the modes' ratio, not absolute seconds.

`arithmetic`: slime's async loop runs the rollout (generation + reward: the engines' side) beside the learner's side
(pi_old recompute, correction, optimizer steps, bookkeeping); the weight update runs alone, generation drained. With
engines and learner on devices of their own, a step takes
    sync:  rollout + reward + recompute + correction + learner step + other + weight update
    async: max(rollout + reward, recompute + correction + learner step + other) + weight update
(the steady state; the first rollout of a run is not overlapped). Colocated on one device nothing overlaps (slime
refuses --async with --colocate, and so does this project).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PRODUCER = ("rollout", "reward")  # the engines' side of a step
CONSUMER = ("recompute", "correction", "learner step", "other")  # the learner's side
ALONE = ("weight update",)  # neither: generation drained, learner idle


def machine() -> str:
    import torch

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"load average {os.getloadavg()[0]:.1f}")


# ------------------------------------------------------------------------------------------------ arithmetic
def overlap_row(mode: str, phases: dict[str, float]) -> str:
    producer = sum(phases.get(p, 0.0) for p in PRODUCER)
    consumer = sum(phases.get(p, 0.0) for p in CONSUMER)
    alone = sum(phases.get(p, 0.0) for p in ALONE)
    sync = producer + consumer + alone
    overlapped = max(producer, consumer) + alone
    return (f"| {mode} | {producer:.3f} | {consumer:.3f} | {alone:.3f} | {sync:.3f} | {overlapped:.3f} | "
            f"{sync / overlapped:.2f}x |")


ARITH_HEADER = ("| mode | engines' side s (rollout + reward) | learner's side s (recompute + correction + learner "
                "step + other) | weight update s | sync step s | async step s | async speed-up |\n"
                "|---|---|---|---|---|---|---|")


def arithmetic(steps_file: str | None) -> str:
    """The table from rl_step_bench's per-step records (medians per phase and mode, warm-up steps left out)."""
    if steps_file is None:  # the CI-sized CPU run of the bench, written to a temporary file
        import tempfile

        sys.path.insert(0, str(REPO / "benchmarks"))
        import rl_step_bench  # noqa: E402

        steps_file = os.path.join(tempfile.mkdtemp(prefix="async_overlap_"), "steps.jsonl")
        rl_step_bench.main(["--shape", "tiny", "--device", "cpu", "--steps", "4", "--clock", "wall", "--out",
                            steps_file])
    records = [json.loads(line) for line in Path(steps_file).read_text().splitlines() if line.strip()]
    modes: dict[str, list[dict]] = {}
    for r in records:
        modes.setdefault(r["mode"], []).append(r)
    first = records[0]
    lines = [f"# phases of rl_step_bench.py ({first['shape']} shape, {first['dtype']}, {first['device']})",
             ARITH_HEADER]
    for mode, rows in modes.items():
        rows = rows[1:] or rows  # the first step of a mode warms up
        phases = {k: statistics.median(r["seconds"].get(k, 0.0) for r in rows) for k in rows[0]["seconds"]}
        lines.append(overlap_row(mode, phases))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ Ray, measured
RAY = ["--use-ray", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2",
       "--ray-cpus-per-actor", "0.5", "--ray-timeout", "600"]


def recipe_args(run_dir: Path, num_rollout: int, seed: int, extra: list[str]) -> list[str]:
    sys.path.insert(0, str(REPO / "examples" / "tiny_cpu"))
    import run as tiny  # noqa: E402  (examples/tiny_cpu/run.py: the recipe and its assets)

    from slime_sparse.tasks.assets import build_assets

    assets = build_assets(REPO / ".cache" / "tiny_assets", tiny.ASSETS, log=lambda m: print(m, file=sys.stderr))
    return [*tiny.RECIPE, *tiny.VARIANTS["sparse_rl"], "--hf-checkpoint", str(assets.model_dir),
            "--prompt-data", str(assets.train_path), "--run-dir", str(run_dir), "--num-rollout", str(num_rollout),
            "--seed", str(seed), "--save-interval", "0", "--no-use-tensorboard", "--no-progress-bar", *RAY, *extra]


def summarize(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "rollout/reward_mean" in r]
    gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    keys = ("perf/rollout_s", "perf/recompute_s", "perf/train_s", "perf/sync_s", "perf/wait_rollout_s", "perf/drain_s")
    out = {"rollouts": len(rows), "wall_per_rollout_s": statistics.median(gaps) if gaps else float("nan"),
           "samples": sum(r.get("correction/seqs", 0) for r in rows[1:]),
           **{k: statistics.median(r.get(k, 0.0) for r in rows[1:]) for k in keys}}
    ledger = run_dir / "samples.jsonl"
    if ledger.exists():
        stale = [json.loads(line)["staleness"] for line in ledger.read_text().splitlines()]
        out["staleness"] = {k: stale.count(k) / len(stale) for k in sorted(set(stale))}
    return out


def ray_study(args) -> str:
    import ray

    from slime_sparse.train import main as train_main

    modes = {"sync": [], "async": ["--async", "--rm-num-workers", "1"]}
    if args.partial:
        modes["async + partial"] = ["--async", "--rm-num-workers", "1", "--partial-rollout",
                                    "--over-sampling-batch-size", "24"]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = {}
    try:
        for name, extra in modes.items():
            run_dir = Path(args.out) / name.replace(" + ", "_")
            shutil.rmtree(run_dir, ignore_errors=True)
            code = train_main(recipe_args(run_dir, args.num_rollout, args.seed, extra))
            if code != 0:
                raise SystemExit(f"{name}: the run failed ({code}); see {run_dir}")
            results[name] = summarize(run_dir)
    finally:
        ray.shutdown()
    lines = [f"# tiny recipe on Ray: 1 learner + 2 engine actors, {args.num_rollout} rollouts, seed {args.seed}; "
             f"{machine()} (shared)",
             "| mode | wall s / rollout | vs sync | rollout s | recompute s | train s | sync s | waited for rollout "
             "s | drain s | staleness (share of samples) |", "|---|---|---|---|---|---|---|---|---|---|"]
    base = results["sync"]["wall_per_rollout_s"]
    for name, r in results.items():
        stale = ", ".join(f"{k}: {v:.2f}" for k, v in r.get("staleness", {}).items()) or "0: 1.00"
        lines.append(f"| {name} | {r['wall_per_rollout_s']:.2f} | {base / r['wall_per_rollout_s']:.2f}x | "
                     f"{r['perf/rollout_s']:.2f} | {r['perf/recompute_s']:.2f} | {r['perf/train_s']:.2f} | "
                     f"{r['perf/sync_s']:.2f} | {r['perf/wait_rollout_s']:.2f} | {r['perf/drain_s']:.2f} | {stale} |")
    (Path(args.out) / "summary.json").write_text(json.dumps(results, indent=2))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("ray", help="sync vs --async on Ray (1 learner + 2 engines), the tiny recipe")
    r.add_argument("--num-rollout", type=int, default=6)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--partial", action="store_true", help="also --async --partial-rollout")
    r.add_argument("--out", default="runs/async_overlap")
    a = sub.add_parser("arithmetic", help="sync vs async step time from rl_step_bench.py's phases")
    a.add_argument("--steps-file", default=None, help="rl_step_bench.py --out file (default: run the CPU tiny one)")
    args = p.parse_args(argv)
    table = ray_study(args) if args.cmd == "ray" else arithmetic(args.steps_file)
    print(table)
    return table


if __name__ == "__main__":
    main()
