"""The long-horizon study's drift-guard tables (#44): when the guard fired, when dense's and naive's accuracies
separated, what the budget that adapts did. Pure functions of the cells' metrics (long_horizon_report.Run), so a
running grid reads the same way as a finished one.

- guard_table: per sparse cell, the probes, the rollout before which the guard's alarm first held (two significant
  probes in a row), how many probes alarmed, the gap at the first and last probe, and the guard's cost (probe
  seconds over the cell's wall seconds, the same process under the same load).
- separation_table: per seed, the first evaluation at which dense GRPO's and naive sparse's greedy accuracies have
  disjoint 95 % Wilson intervals (128 prompts each), beside the rollout at which the guard in the naive cell first
  fired. The evaluation after rollout k and the probe before rollout k + 1 see the same weights.
- adaptive_table: per `sparse_rl_drift` cell, the budget's moves, its last dense accuracy against dense GRPO's
  interval at the same evaluation, and the KV it saved over the run against the static budget's.
"""
from __future__ import annotations

import json
import os
import re

from long_horizon_report import Run, pooled, wilson

SPARSE = ("naive_sparse", "sparse_rl", "sparse_rl_paper", "smd", "sparse_rl_seq_is", "sparse_rl_drift")


def seed_of(run: Run) -> int:
    match = re.search(r"-seed(\d+)$", run.path.rstrip("/"))
    return int(match.group(1)) if match else -1


def probes(run: Run) -> list[dict]:
    return [r for r in run.rollouts if "drift/reward_gap" in r]


def first_alarm(run: Run) -> int | None:
    return next((r["step"] for r in probes(run) if r.get("drift/alarm")), None)


def guard_cost(run: Run) -> float:
    """Seconds in the probe over the cell's wall seconds (cell_time.jsonl), for the rollouts both cover."""
    wall = sum(t["wall_s"] for t in run.times)
    spent = sum(r.get("perf/drift_probe_s", 0.0) for r in run.rollouts)
    return spent / wall if wall else float("nan")


def _gap(row: dict) -> str:
    return f"{row['drift/reward_gap']:+.3f} ± {row['drift/reward_gap_se']:.3f}"


def guard_table(runs: dict[tuple[str, str], list[Run]]) -> str:
    lines = ["| budget | variant | seed | probes | first alarm (before rollout) | probes alarmed | gap at first probe "
             "(dense − R-KV ± se) | gap at last probe | compressed frac. (first → last) | answers agree (first → last)"
             " | guard cost (share of wall time) |", "|" + " --- |" * 11]
    for (budget, variant), rs in runs.items():
        if variant not in SPARSE:
            continue
        for r in sorted(rs, key=seed_of):
            ps = probes(r)
            if not ps:
                continue
            first, last = ps[0], ps[-1]
            lines.append(
                f"| {budget} | {variant} | {seed_of(r)} | {len(ps)} | {first_alarm(r) or 'never'} | "
                f"{sum(bool(p.get('drift/alarm')) for p in ps)} | {_gap(first)} | {_gap(last)} | "
                f"{first['drift/compressed_frac']:.2f} → {last['drift/compressed_frac']:.2f} | "
                f"{first['drift/answer_agreement']:.2f} → {last['drift/answer_agreement']:.2f} | "
                f"{100 * guard_cost(r):.1f} % |")
    return "\n".join(lines) if len(lines) > 2 else ""


def separation(dense: Run, naive: Run) -> int | None:
    """The first evaluation step (> 0) at which the two runs' dense greedy accuracies have disjoint Wilson
    intervals; None: never (so far)."""
    for step in sorted(set(dense.evals["dense"]) & set(naive.evals["dense"])):
        if step == 0:
            continue
        (a, n), (b, m) = dense.evals["dense"][step], naive.evals["dense"][step]
        lo_a, hi_a = wilson(a * n, n)
        lo_b, hi_b = wilson(b * m, m)
        if hi_b < lo_a or hi_a < lo_b:
            return step
    return None


def separation_table(runs: dict[tuple[str, str], list[Run]]) -> str:
    """Both events counted in rollouts trained: the evaluation after rollout s sees s; the probe before rollout f,
    f - 1. The guard's lead is the difference (> 0: it fired on earlier weights)."""
    lines = ["| budget | seed | dense vs naive intervals first disjoint (rollouts trained) | dense / naive acc. there | "
             "naive cell's guard first alarmed (rollouts trained) | guard's lead (rollouts) |", "|" + " --- |" * 6]
    for (budget, variant), rs in runs.items():
        if variant != "naive_sparse" or (budget, "dense") not in runs:
            continue
        dense = {seed_of(r): r for r in runs[(budget, "dense")]}
        for naive in sorted(rs, key=seed_of):
            d = dense.get(seed_of(naive))
            if d is None or not naive.evals["dense"]:
                continue
            sep, fired = separation(d, naive), first_alarm(naive)
            trained = None if fired is None else fired - 1
            accs = f"{d.evals['dense'][sep][0]:.3f} / {naive.evals['dense'][sep][0]:.3f}" if sep else "-"
            lead = f"{sep - trained:+d}" if sep is not None and trained is not None else "-"
            lines.append(f"| {budget} | {seed_of(naive)} | {sep if sep else 'not by ' + str(max(naive.evals['dense']))}"
                         f" | {accs} | {trained if trained is not None else 'never'} | {lead} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def moves(run: Run) -> str:
    path = os.path.join(run.path, "summary.json")
    if not os.path.isfile(path):
        return "-"
    with open(path, encoding="utf-8") as fh:
        drift = json.load(fh).get("drift") or {}
    changes = drift.get("changes") or []
    return ", ".join(f"{c['from']} → {c['to']} (rollout {c['rollout']})" for c in changes) or "none"


def adaptive_table(runs: dict[tuple[str, str], list[Run]]) -> str:
    lines = ["| budget | seed | rollouts | budget moves | dense acc. at the last eval [95 % CI] | dense GRPO there "
             "[95 % CI] | inside dense's interval | KV saved over the run (adaptive / static `mis`) |",
             "|" + " --- |" * 8]
    for (budget, variant), rs in runs.items():
        if variant != "sparse_rl_drift":
            continue
        dense = {seed_of(r): r for r in runs.get((budget, "dense"), [])}
        static = {seed_of(r): r for r in runs.get((budget, "sparse_rl"), [])}
        for r in sorted(rs, key=seed_of):
            if not r.evals["dense"]:
                continue
            step = max(r.evals["dense"])
            acc, n = r.evals["dense"][step]
            lo, hi = wilson(acc * n, n)
            d = dense.get(seed_of(r))
            if d is not None and step in d.evals["dense"]:
                dm, dlo, dhi, _ = pooled([d], "dense", step)
                there, inside = f"{dm:.3f} [{dlo:.3f}, {dhi:.3f}]", "yes" if dlo <= acc <= dhi else "no"
            else:
                there, inside = "-", "-"
            saved = r.rollouts[-1].get("drift/run_kv_savings", float("nan"))
            s = static.get(seed_of(r))
            ref = f"{s.rollouts[-1]['drift/run_kv_savings']:.3f}" if s and "drift/run_kv_savings" in s.rollouts[-1] \
                else "-"
            lines.append(f"| {budget} | {seed_of(r)} | {len(r.rollouts)} | {moves(r)} | {acc:.3f} [{lo:.3f}, {hi:.3f}]"
                         f" | {there} | {inside} | {saved:.3f} / {ref} |")
    return "\n".join(lines) if len(lines) > 2 else ""
