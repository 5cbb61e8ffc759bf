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

# Reward, KV savings, sequence rejection rate, sampler/learner mismatch (k3 KL) and its sparsity / numeric parts,
# the tail statistics the peers alarm on (Sparrow's p5 of pi_old / pi_sparse, verl's IS effective sample size), samples
# that carry a gradient, and what dynamic sampling costs (tokens generated per token trained; 1 without it).
DEFAULT_PLOT_KEYS = ("rollout/reward_mean", "kv/savings", "correction/seq_reject_rate", "mismatch/k3",
                     "mismatch/sparsity/k3", "mismatch/numeric/k3", "mismatch/xi_p5", "correction/is_ess",
                     "rollout/effective_batch_size", "rollout/gen_tokens_per_train_token")
SUMMARY_FILE = "summary.png"


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
    series = {}
    for key in keys:
        steps, values = metric_series(records, key)
        if steps:
            series[key] = (steps, values)
        else:
            result.missing_keys.append(key)
            logger.info("metric %r has no finite value in %s: not plotted", key, run_dir)

    for key, (steps, values) in series.items():
        fig, ax = _new_figure(1, 1, (6.0, 4.0))
        _draw(ax[0], key, steps, values, smooth)
        path = os.path.join(out_dir, _file_name(key) + ".png")
        _save(fig, path)
        result.files.append(path)

    if series:
        ncols = min(2, len(series))
        nrows = math.ceil(len(series) / ncols)
        fig, axes = _new_figure(nrows, ncols, (6.0 * ncols, 3.5 * nrows))
        for ax, (key, (steps, values)) in zip(axes, series.items()):
            _draw(ax, key, steps, values, smooth)
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


def _draw(ax, key: str, steps: list[int], values: list[float], smooth: float) -> None:
    if smooth:
        ax.plot(steps, values, color="C0", alpha=0.3, linewidth=1.0, label="raw")
        ax.plot(steps, ema(values, smooth), color="C0", linewidth=1.8, label=f"ema {smooth:g}")
        ax.legend(loc="best", fontsize="small")
    else:
        ax.plot(steps, values, color="C0", linewidth=1.5, marker="." if len(steps) < 50 else None)
    ax.set_title(key)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)


def _save(fig, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)  # attaches an Agg canvas: no GUI backend, whatever matplotlib's default is
    fig.savefig(path, dpi=100)


def _file_name(key: str) -> str:
    """'rollout/reward_mean' -> 'rollout_reward_mean'."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("_") or "metric"
