"""Per-layer budgets as data: how many slots each layer keeps after a compression (`--kv-budget-schedule`).

- uniform: every layer keeps B = --kv-budget;
- pyramid: PyramidKV (Cai et al., arXiv 2406.02069, section 3.3): an arithmetic sequence over depth, the first
  layer keeping the most, by one of two rules (the preset's `pyramid`, presets.py):
  ours (every preset but kvpress): with S = B - window - sinks (what a layer selects; the protected slots are kept
  by every layer whatever its budget, so they stay out of the pyramid), the last layer selects floor(S / beta) and
  the first 2S - floor(S / beta), the others linearly in between; every layer then adds its window and sinks. The
  mean over layers is exactly B (pairs of layers equidistant from the middle sum to 2B; rounding is mirrored so it
  stays so), so a pyramid run keeps as many KV tokens as a uniform one once compressing (schedule.py: before the
  first compression every layer fills to the largest budget + buffer), and the largest budget
  2S - floor(S / beta) + window + sinks does not depend on the number of layers;
  kvpress's (`kvpress_layer_budget`, its PyramidKVPress.get_layer_budget): the pyramid spans the whole budget,
  window included (the last layer B / beta, the first 2B - B / beta, each layer round()ed on its own, so the mean
  may drift from B by rounding), its top is capped at the layer's cache length minus the window, and where the
  pyramid does not fit (its bottom below the window) every layer keeps B;
- explicit: --kv-layer-budgets, one per layer.

The schedule (schedule.py) needs only the extremes, which never depend on the layer count: `budget_range`.
"""
from __future__ import annotations

from typing import Sequence

from .config import KVCompressConfig
from .presets import PRESETS


def layer_budgets(cfg: KVCompressConfig, num_layers: int, lengths: Sequence[int] | None = None) -> tuple[int, ...]:
    """Slots layer l keeps after a compression, l = 0 .. num_layers - 1.

    lengths: the slots each layer holds at this compression, which only kvpress's pyramid reads (its cap); None: no
    cap, the budgets of a cache too long for it to bind, which the embedded engine fixes for a whole run (its rows
    are sized by them, schedule.py)."""
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
    if _kvpress_rule(cfg):
        if lengths is not None and len(lengths) != num_layers:
            raise ValueError(f"got {len(lengths)} cache lengths for {num_layers} layers")
        return tuple(kvpress_layer_budget(cfg.budget, cfg.window, cfg.pyramid_beta, num_layers, layer,
                                          None if lengths is None else lengths[layer]) for layer in range(num_layers))
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


def kvpress_layer_budget(budget: int, window: int, beta: float, num_layers: int, layer: int,
                         q_len: int | None) -> int:
    """kvpress 0.5.5's PyramidKVPress.get_layer_budget(module, q_len), step for step (the same float operations in
    the same order, so the same round()s, half to even), with its q_len * (1 - compression_ratio) = budget: equal
    wherever that product is exactly the integer `budget`. q_len None: no cap (any q_len too long to bind it)."""
    max_capacity_prompt = window + budget
    min_num = (max_capacity_prompt - window) / beta
    max_num = (max_capacity_prompt - window) * 2 - min_num
    if q_len is not None and max_num >= q_len - window:
        max_num = q_len - window
        min_num = (max_capacity_prompt - window) * 2 - max_num
    if not ((q_len is None or q_len >= max_num) and max_num >= min_num >= window):
        return max(1, round(budget))  # kvpress's fallback: SnapKV's uniform budget
    steps = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else 0.0
    return round(max_num - layer * steps)


def budget_range(cfg: KVCompressConfig) -> tuple[int, int]:
    """(smallest, largest) layer budget, for any model of at least 2 layers (one layer under pyramid: its budget
    is the mean, inside this range); under kvpress's pyramid, of `layer_budgets` without lengths, the smallest
    floor(B / beta), at most one below the deepest layer's (round())."""
    if cfg.schedule == "uniform":
        return cfg.budget, cfg.budget
    if cfg.schedule == "explicit":
        return min(cfg.layer_budgets), max(cfg.layer_budgets)
    if _kvpress_rule(cfg):
        largest = kvpress_layer_budget(cfg.budget, cfg.window, cfg.pyramid_beta, 2, 0, None)
        if largest == cfg.budget:  # the fallback: every layer keeps the budget
            return largest, largest
        return int(cfg.budget / cfg.pyramid_beta), largest
    protected = cfg.window + cfg.sinks
    selectable = cfg.budget - protected
    top = int(selectable // cfg.pyramid_beta)
    return protected + top, protected + 2 * selectable - top


def _kvpress_rule(cfg: KVCompressConfig) -> bool:
    """Does this config's pyramid follow kvpress's rule? Its preset says (presets.py); a custom config takes ours."""
    return cfg.preset in PRESETS and PRESETS[cfg.preset].pyramid == "kvpress"
