"""Per-layer budgets as data: how many slots each layer keeps after a compression (`--kv-budget-schedule`).

- uniform: every layer keeps B = --kv-budget;
- pyramid: PyramidKV (Cai et al., arXiv 2406.02069, section 3.3): an arithmetic sequence over depth, the first
  layer keeping the most. With S = B - window - sinks (what a layer selects; the protected slots are kept by every
  layer whatever its budget, so they stay out of the pyramid), the last layer selects floor(S / beta) and the first
  2S - floor(S / beta), the others linearly in between; every layer then adds its window and sinks. The mean over
  layers is exactly B (pairs of layers equidistant from the middle sum to 2B; rounding is mirrored so it stays
  so), so a pyramid run keeps as many KV tokens as a uniform one once compressing (schedule.py: before the first
  compression every layer fills to the largest budget + buffer), and the
  largest budget 2S - floor(S / beta) + window + sinks does not depend on the number of layers;
- explicit: --kv-layer-budgets, one per layer.

The schedule (schedule.py) needs only the extremes, which never depend on the layer count: `budget_range`.
"""
from __future__ import annotations

from .config import KVCompressConfig


def layer_budgets(cfg: KVCompressConfig, num_layers: int) -> tuple[int, ...]:
    """Slots layer l keeps after a compression, l = 0 .. num_layers - 1."""
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers} must be >= 1")
    schedule = cfg.schedule
    if schedule == "uniform":
        return (cfg.budget,) * num_layers
    if schedule == "explicit":
        if len(cfg.layer_budgets) != num_layers:
            raise ValueError(f"--kv-layer-budgets lists {len(cfg.layer_budgets)} budgets, the model has "
                             f"{num_layers} layers")
        return tuple(cfg.layer_budgets)
    if num_layers < 2:
        raise ValueError("--kv-budget-schedule pyramid needs a model of at least 2 layers")
    protected = cfg.window + cfg.sinks
    return tuple(protected + s for s in pyramid(cfg.budget - protected, num_layers, cfg.pyramid_beta))


def pyramid(mean: int, num_layers: int, beta: float) -> tuple[int, ...]:
    """PyramidKV's arithmetic sequence of `num_layers` ints, non-increasing, summing to mean * num_layers: the last
    floor(mean / beta), the first 2 * mean minus that. Layer l and layer L - 1 - l sum to 2 * mean."""
    if mean < 0 or beta < 1 or num_layers < 2:
        raise ValueError(f"pyramid needs mean >= 0, beta >= 1 and 2+ layers, got {mean}, {beta}, {num_layers}")
    top = int(mean // beta)
    bottom = 2 * mean - top
    step = (bottom - top) / (num_layers - 1)
    half = [int(bottom - layer * step + 0.5) for layer in range(num_layers // 2)]  # round half up, then mirror
    middle = [mean] if num_layers % 2 else []
    return tuple(half + middle + [2 * mean - x for x in reversed(half)])


def budget_range(cfg: KVCompressConfig) -> tuple[int, int]:
    """(smallest, largest) layer budget, for any model of at least 2 layers (one layer under pyramid: its budget
    is the mean, inside this range)."""
    if cfg.schedule == "uniform":
        return cfg.budget, cfg.budget
    if cfg.schedule == "explicit":
        return min(cfg.layer_budgets), max(cfg.layer_budgets)
    protected = cfg.window + cfg.sinks
    selectable = cfg.budget - protected
    top = int(selectable // cfg.pyramid_beta)
    return protected + top, protected + 2 * selectable - top
