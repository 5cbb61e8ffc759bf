"""The long-horizon study's aggregation: per-run series, collapse events, the tables and the plot.

Pure functions of the cells' metrics.jsonl (and cell_time.jsonl), so a finished or a running grid reads the
same way. Accuracies are greedy pass@1 (a full score: the total and every key) on the held-out prompts; their
95 % intervals are Wilson intervals of the outcomes pooled over the seeds (n = seeds x prompts: the prompt
sampling noise; the seeds' own spread is shown as [min, max]). Rollout statistics are means over the first and
the last 10 rollouts that every seed of a row has run.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field

from slime_sparse.utils.logging import read_metrics

WINDOW = 10  # rollouts averaged at the start and the end of a run
REWARD_DROP = 0.5  # collapse: the smoothed reward falls below this fraction of its best so far
ENTROPY_DROP = 0.1  # collapse: the sampler's entropy falls below this fraction of its first rollouts'
SPIKE = 5.0  # a gradient-norm spike: above this multiple of the median of the previous 20 rollouts
SMOOTH = 5  # rollouts of the trailing mean the collapse rules read


@dataclass
class Run:
    path: str
    rollouts: list[dict]  # one record per rollout (those with rollout/reward_mean), by step
    evals: dict[str, dict[int, tuple[float, int]]]  # mode -> step -> (pass@1, prompts)
    times: list[dict] = field(default_factory=list)  # cell_time.jsonl

    def series(self, key: str) -> tuple[list[int], list[float]]:
        pts = [(r["step"], r[key]) for r in self.rollouts if r.get(key) is not None]
        return [s for s, _ in pts], [v for _, v in pts]


def load_run(run_dir: str) -> Run:
    records = read_metrics(run_dir)
    rollouts = sorted((r for r in records if "rollout/reward_mean" in r), key=lambda r: r["step"])
    evals: dict[str, dict[int, tuple[float, int]]] = {}
    for mode in ("dense", "sparse"):
        evals[mode] = {r["step"]: (r[f"eval_{mode}/pass@1"], int(r.get(f"eval_{mode}/n_prompts") or 0))
                       for r in records if r.get(f"eval_{mode}/pass@1") is not None}
    times_path = os.path.join(run_dir, "cell_time.jsonl")
    times = []
    if os.path.isfile(times_path):
        with open(times_path, encoding="utf-8") as fh:
            times = [json.loads(line) for line in fh if line.strip()]
    return Run(run_dir, rollouts, evals, times)


def last_step(run_dir: str) -> int:
    """The last rollout a run directory has metrics for (0: none)."""
    if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        return 0
    return max((r["step"] for r in read_metrics(run_dir) if "rollout/reward_mean" in r), default=0)


def is_complete(run_dir: str, num_rollout: int) -> bool:
    """Whether a run directory has finished `num_rollout` rollouts (a shorter finished run is extended)."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as fh:
        summary = json.load(fh)
    return summary.get("status") == "complete" and summary.get("last_rollout", 0) >= num_rollout


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95 % for z = 1.96)."""
    if n <= 0:
        return float("nan"), float("nan")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def pooled(runs: list[Run], mode: str, step: int) -> tuple[float, float, float, list[float]]:
    """(mean, 95 % low, high, per-seed values) of greedy pass@1 at `step`, pooled over the runs that have it."""
    points = [r.evals[mode][step] for r in runs if step in r.evals.get(mode, {})]
    n = sum(p for _, p in points)
    k = sum(acc * p for acc, p in points)
    lo, hi = wilson(k, n)
    return (k / n if n else float("nan")), lo, hi, [acc for acc, _ in points]


def common_eval_steps(runs: list[Run], mode: str) -> list[int]:
    steps = [set(r.evals.get(mode, {})) for r in runs]
    return sorted(set.intersection(*steps)) if steps else []


def common_rollouts(runs: list[Run]) -> int:
    return min((len(r.rollouts) for r in runs), default=0)


def window_mean(runs: list[Run], key: str, end: bool) -> float:
    """Mean over the runs of `key` over the first (or last) WINDOW rollouts all of them have."""
    n = common_rollouts(runs)
    vals = []
    for r in runs:
        part = r.rollouts[:n][-WINDOW:] if end else r.rollouts[:WINDOW]
        vals += [x[key] for x in part if x.get(key) is not None]
    return statistics.fmean(vals) if vals else float("nan")


def trailing_mean(values: list[float], window: int = SMOOTH) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def entropy_series(run: Run) -> tuple[list[int], list[float]]:
    """The sampler's per-token entropy estimate: the mean -log pi_sparse of its own samples (log sampler ppl)."""
    steps, ppl = run.series("mismatch/sampler_ppl")
    return steps, [math.log(p) for p in ppl]


def collapse_events(run: Run) -> dict:
    """The first rollout of each collapse (None: never) and the gradient-norm spikes.

    reward_halved: the trailing mean of the reward falls below REWARD_DROP x its best so far; entropy_collapse:
    that of the sampler's entropy falls below ENTROPY_DROP x its mean over the first SMOOTH rollouts;
    grad_spikes: rollouts whose gradient norm exceeds SPIKE x the median of the previous 20 (from rollout 11).
    """
    steps, reward = run.series("rollout/reward_mean")
    halved, best = None, -math.inf
    for s, v in zip(steps, trailing_mean(reward)):
        best = max(best, v)
        if halved is None and best > 0 and v < REWARD_DROP * best:
            halved = s
    e_steps, ent = entropy_series(run)
    collapsed = None
    if len(ent) > SMOOTH:
        floor = ENTROPY_DROP * statistics.fmean(ent[:SMOOTH])
        collapsed = next((s for s, v in zip(e_steps, trailing_mean(ent)) if v < floor), None)
    g_steps, grad = run.series("train/grad_norm")
    spikes = [s for i, s in enumerate(g_steps)
              if i >= 10 and grad[i] > SPIKE * statistics.median(grad[max(0, i - 20): i])]
    return {"reward_halved": halved, "entropy_collapse": collapsed, "grad_spikes": spikes,
            "grad_norm_max": max(grad, default=float("nan"))}


def _acc(runs: list[Run], mode: str) -> str:
    steps = common_eval_steps(runs, mode)
    if not steps:
        return "-"
    m0, _, _, _ = pooled(runs, mode, steps[0])
    m1, lo, hi, per_seed = pooled(runs, mode, steps[-1])
    spread = f" (seeds {min(per_seed):.2f}-{max(per_seed):.2f})" if len(per_seed) > 1 else ""
    return f"{m0:.3f} → {m1:.3f} [{lo:.3f}, {hi:.3f}]{spread}"


def _pair(runs: list[Run], key: str, fmt: str) -> str:
    a, b = window_mean(runs, key, end=False), window_mean(runs, key, end=True)
    return "-" if math.isnan(a) else f"{a:{fmt}} → {b:{fmt}}"


def study_table(runs: dict[tuple[str, str], list[Run]], budgets: dict[str, int]) -> str:
    """One markdown row per (budget, variant): accuracies first and last evaluation, rollout statistics."""
    head = ("| budget | variant | seeds | rollouts | dense acc. start → end [95 % CI] | sparse acc. start → end "
            "[95 % CI] | reward (T=1) | length | k3 | sparsity k3 | xi p5 | seq. rejected |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for (budget, variant), rs in runs.items():
        lines.append(
            f"| {budget} (B={budgets.get(budget, '?')}) | {variant} | {len(rs)} | {common_rollouts(rs)} | "
            f"{_acc(rs, 'dense')} | {_acc(rs, 'sparse')} | {_pair(rs, 'rollout/reward_mean', '.3f')} | "
            f"{_pair(rs, 'rollout/response_len_mean', '.0f')} | {_pair(rs, 'mismatch/k3', '.3f')} | "
            f"{_pair(rs, 'mismatch/sparsity/k3', '.3f')} | {_pair(rs, 'mismatch/xi_p5', '.3f')} | "
            f"{_pair(rs, 'correction/seq_reject_rate', '.3f')} |")
    return "\n".join(lines) + (f"\n(start → end: first → last evaluation every seed has; rollout columns: mean of the "
                               f"first → last {WINDOW} rollouts every seed has run)")


def events_table(runs: dict[tuple[str, str], list[Run]]) -> str:
    """Collapse events per (budget, variant): how many seeds had each, and when."""
    lines = ["| budget | variant | reward halved | entropy collapse | grad-norm spikes | max grad norm |",
             "| --- | --- | --- | --- | --- | --- |"]
    for (budget, variant), rs in runs.items():
        ev = [collapse_events(r) for r in rs]

        def when(key: str) -> str:
            hits = [e[key] for e in ev if e[key] is not None]
            return f"{len(hits)}/{len(ev)}" + (f" (rollout {', '.join(map(str, hits))})" if hits else "")

        spikes = sum(len(e["grad_spikes"]) for e in ev)
        lines.append(f"| {budget} | {variant} | {when('reward_halved')} | {when('entropy_collapse')} | "
                     f"{spikes} | {max(e['grad_norm_max'] for e in ev):.3g} |")
    return "\n".join(lines)


def time_table(runs: dict[tuple[str, str], list[Run]]) -> str:
    """CPU and wall time of the cells (cell_time.jsonl), per (budget, variant) and in all."""
    lines = ["| budget | variant | rollouts run | CPU h | wall h |", "| --- | --- | --- | --- | --- |"]
    cpu_all = wall_all = 0.0
    for (budget, variant), rs in runs.items():
        cpu = sum(t["cpu_s"] for r in rs for t in r.times) / 3600
        wall = sum(t["wall_s"] for r in rs for t in r.times) / 3600
        cpu_all, wall_all = cpu_all + cpu, wall_all + wall
        lines.append(f"| {budget} | {variant} | {sum(len(r.rollouts) for r in rs)} | {cpu:.2f} | {wall:.2f} |")
    lines.append(f"| all | | | {cpu_all:.2f} | {wall_all:.2f} |")
    return "\n".join(lines)


def parts_table(runs: dict[tuple[str, str], list[Run]], out: str) -> str:
    """The answers of each cell's latest model by part (parts.json, `long_horizon.py parts`), mean over seeds:
    worked fraction, totals right, keys right in worked answers, full scores; dense | R-KV inference."""
    lines = ["| budget | variant | seeds | rollout | worked (dense / R-KV) | total right | keys right, worked answers "
             "| full score |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = {}
    for (budget, variant), rs in runs.items():
        paths = [os.path.join(r.path, "parts.json") for r in rs]
        base, _, assets = budget.partition(" assets")  # long_horizon.label: "quarter assets7" -> assets7/quarter
        warm = os.path.join(out, *([f"assets{assets}"] if assets else []), base, "warm_start_parts.json")
        if os.path.isfile(warm):
            rows.setdefault((budget, "warm start"), [warm])
        rows[(budget, variant)] = [p for p in paths if os.path.isfile(p)]
    for (budget, variant), paths in rows.items():
        if not paths:
            continue
        parts = []
        for p in paths:
            with open(p, encoding="utf-8") as fh:
                parts.append(json.load(fh))

        def cell(key: str) -> str:
            return " / ".join(f"{statistics.fmean(p[m][key] for p in parts):.3f}" for m in ("dense", "sparse"))

        steps = sorted({p["rollout"] for p in parts})
        lines.append(f"| {budget} | {variant} | {len(parts)} | {', '.join(map(str, steps))} | {cell('worked')} | "
                     f"{cell('total')} | {cell('keys_worked')} | {cell('full')} |")
    return "\n".join(lines) if len(lines) > 2 else ""


PANELS = (("eval:dense", "greedy pass@1, dense inference"), ("eval:sparse", "greedy pass@1, R-KV inference"),
          ("rollout/reward_mean", "rollout reward (T=1)"), ("rollout/response_len_mean", "response length"),
          ("mismatch/k3", "mismatch k3 (pi_old || pi_sparse)"))


def plot_study(runs: dict[tuple[str, str], list[Run]], budgets: dict[str, int], path: str) -> str:
    """One PNG, a row per budget: accuracies (pooled mean, 95 % band), rollout curves (seed mean, min-max band,
    trailing mean of SMOOTH rollouts)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [b for b in budgets if any(k[0] == b for k in runs)]
    variants = list(dict.fromkeys(v for _, v in runs))
    fig = Figure(figsize=(4 * len(PANELS), 3.4 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), len(PANELS), squeeze=False)
    for row, budget in zip(axes, rows):
        for variant in variants:
            rs = runs.get((budget, variant))
            if not rs:
                continue
            color = f"C{variants.index(variant)}"
            for ax, (key, _) in zip(row, PANELS):
                if key.startswith("eval:"):
                    mode = key.split(":")[1]
                    steps = common_eval_steps(rs, mode)
                    stats = [pooled(rs, mode, s) for s in steps]
                    ax.plot(steps, [m for m, *_ in stats], color=color, marker=".", label=f"{variant} ({len(rs)})")
                    ax.fill_between(steps, [lo for _, lo, _, _ in stats], [hi for _, _, hi, _ in stats],
                                    color=color, alpha=0.15)
                    continue
                n = common_rollouts(rs)
                curves = [trailing_mean([x.get(key) or 0.0 for x in r.rollouts[:n]]) for r in rs]
                if not n:
                    continue
                cols = list(zip(*curves))
                steps = [x["step"] for x in rs[0].rollouts[:n]]
                ax.plot(steps, [statistics.fmean(c) for c in cols], color=color)
                ax.fill_between(steps, [min(c) for c in cols], [max(c) for c in cols], color=color, alpha=0.15)
        for ax, (_, title) in zip(row, PANELS):
            ax.set_title(f"{title}\n{budget} budget (B={budgets[budget]})", fontsize="medium")
            ax.set_xlabel("rollout")
            ax.grid(True, alpha=0.3)
        row[0].legend(fontsize="small", loc="best")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=80)
    return path
