"""PNG plots of a run's curves from its metrics.jsonl (matplotlib's Agg canvas: no display, no pyplot state)."""
from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Sequence

from slime_sparse.utils.logging import read_metrics

logger = logging.getLogger(__name__)

# One panel of every evaluation's greedy accuracy: eval_<mode>/pass@1 and eval_<mode>/<set>/pass@1, one line each
# (dense, sparse, per named set). Not a metric of its own: a key `plot_metrics` gathers.
EVAL_ACCURACY_KEY = "eval/pass@1"
_EVAL_KEY = re.compile(r"^eval_([^/]+)/(?:(.+)/)?pass@1$")
# Evaluation accuracy (the headline), reward, KV savings, sequence rejection rate, sampler/learner mismatch (k3 KL)
# and its sparsity / numeric parts, the tail statistics the peers alarm on (Sparrow's p5 of pi_old / pi_sparse, verl's
# IS effective sample size), the drift guard's reward gap (dense minus compressed answers of held-out prompts),
# samples that carry a gradient, and what dynamic sampling costs (tokens generated per token trained; 1 without it).
DEFAULT_PLOT_KEYS = (EVAL_ACCURACY_KEY, "rollout/reward_mean", "kv/savings", "correction/seq_reject_rate",
                     "mismatch/k3", "mismatch/sparsity/k3", "mismatch/numeric/k3", "mismatch/xi_p5",
                     "drift/reward_gap", "correction/is_ess", "rollout/effective_batch_size", "rollout/gen_tokens_per_train_token")
SUMMARY_FILE = "summary.png"

Series = tuple[str, list[int], list[float]]  # (label, steps, values)


@dataclass
class PlotResult:
    files: list[str] = field(default_factory=list)  # written PNGs: one per plotted key, then the summary grid
    missing_keys: list[str] = field(default_factory=list)  # requested keys with no finite value in the log


def metric_series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`, ordered by step. Null (non-finite) values are left out; when a step appears
    more than once the last record wins."""
    by_step: dict[int, float] = {}
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            by_step[record["step"]] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def ema(values: Sequence[float], weight: float) -> list[float]:
    """Exponential moving average s_t = weight * s_{t-1} + (1 - weight) * x_t, started at s_0 = x_0."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight!r}")
    out: list[float] = []
    for x in values:
        out.append(x if not out else weight * out[-1] + (1.0 - weight) * x)
    return out


def panel_series(records: Sequence[dict], key: str) -> list[Series]:
    """The curves of one panel: the metric `key` itself, or for EVAL_ACCURACY_KEY every evaluation's pass@1
    (labelled "dense", "sparse", "dense gsm8k", ...)."""
    if key != EVAL_ACCURACY_KEY:
        steps, values = metric_series(records, key)
        return [(key, steps, values)] if steps else []
    out = []
    names = {k for r in records for k in r if _EVAL_KEY.match(k)}
    for name in sorted(names, key=lambda k: tuple(g or "" for g in _EVAL_KEY.match(k).groups())):  # dense first
        mode, dataset = _EVAL_KEY.match(name).groups()
        steps, values = metric_series(records, name)
        if steps:
            out.append((mode if dataset is None else f"{mode} {dataset}", steps, values))
    return out


def available_keys(records: Sequence[dict]) -> list[str]:
    return sorted({k for r in records for k in r if k not in ("step", "time")})


def plot_metrics(
    run_dir: str,
    keys: Sequence[str] = DEFAULT_PLOT_KEYS,
    out_dir: str | None = None,
    smooth: float = 0.0,
) -> PlotResult:
    """Write `<out_dir>/<key>.png` for each key found in `run_dir/metrics.jsonl`, plus a summary grid.

    out_dir defaults to `run_dir/plots`. Keys without any finite value are skipped and listed in
    `missing_keys` (with a log note), so one set of keys serves runs that log different metrics.
    smooth > 0 overlays an exponential moving average of that weight on the raw curve.
    """
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth (--smooth) must be in [0, 1), got {smooth!r}")
    records = read_metrics(run_dir)
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)

    result = PlotResult()
    series: dict[str, list[Series]] = {}
    for key in keys:
        curves = panel_series(records, key)
        if curves:
            series[key] = curves
        else:
            result.missing_keys.append(key)
            logger.info("metric %r has no finite value in %s: not plotted", key, run_dir)

    for key, curves in series.items():
        fig, ax = _new_figure(1, 1, (6.0, 4.0))
        _draw(ax[0], key, curves, smooth)
        path = os.path.join(out_dir, _file_name(key) + ".png")
        _save(fig, path)
        result.files.append(path)

    if series:
        ncols = min(2, len(series))
        nrows = math.ceil(len(series) / ncols)
        fig, axes = _new_figure(nrows, ncols, (6.0 * ncols, 3.5 * nrows))
        for ax, (key, curves) in zip(axes, series.items()):
            _draw(ax, key, curves, smooth)
        for ax in axes[len(series):]:
            ax.set_visible(False)
        path = os.path.join(out_dir, SUMMARY_FILE)
        _save(fig, path)
        result.files.append(path)
    return result


def _new_figure(nrows: int, ncols: int, size: tuple[float, float]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel().tolist()
    return fig, axes


def _draw(ax, key: str, curves: list[Series], smooth: float) -> None:
    """One panel. A metric logged on every rollout is a line; one logged on some rollouts only (the mismatch split,
    every --mismatch-metrics-interval-th) is points, since a line would invent the rollouts in between; evaluations
    (every --eval-interval) are lines through their points, one per mode / set."""
    evals = key == EVAL_ACCURACY_KEY
    for i, (label, steps, values) in enumerate(curves):
        color = f"C{i}"
        consecutive = all(b - a == 1 for a, b in zip(steps, steps[1:]))
        if evals:
            ax.plot(steps, values, color=color, linewidth=1.5, marker="o", markersize=4, label=label)
        elif not consecutive:
            ax.plot(steps, values, color=color, linestyle="none", marker="o", markersize=4)
        elif smooth:
            ax.plot(steps, values, color=color, alpha=0.3, linewidth=1.0, label="raw")
            ax.plot(steps, ema(values, smooth), color=color, linewidth=1.8, label=f"ema {smooth:g}")
        else:
            ax.plot(steps, values, color=color, linewidth=1.5, marker="." if len(steps) < 50 else None)
    if ax.get_legend_handles_labels()[1]:
        ax.legend(loc="best", fontsize="small")
    ax.set_title("eval accuracy (pass@1)" if evals else key)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)


def _save(fig, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)  # attaches an Agg canvas: no GUI backend, whatever matplotlib's default is
    fig.savefig(path, dpi=100)


def _file_name(key: str) -> str:
    """'rollout/reward_mean' -> 'rollout_reward_mean'."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("_") or "metric"
