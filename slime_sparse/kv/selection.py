"""Which cache slots survive a compression: top-k under protection of sinks and window, per head/layer/model."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .budgets import layer_budgets
from .config import KVCompressConfig
from .scoring import score_layer


def select_kept(scores: Tensor, budget: int, cfg: KVCompressConfig) -> Tensor:
    """Sorted LongTensor [..., budget] of kept slots, from scores [..., n] (higher = keep).

    Always the first cfg.sinks and the last cfg.protected_window slots, plus the (budget - sinks - window) best-scored
    slots between them; ties go to the earlier slot (stable sort), so selection is deterministic on every device.
    If n <= budget nothing is dropped: arange(n) for every row. Scores of the middle slots must not be NaN.
    """
    n = scores.shape[-1]
    batch_shape = scores.shape[:-1]
    device = scores.device
    if n <= budget:
        return torch.arange(n, device=device).expand(*batch_shape, n).clone()
    sinks, window = cfg.sinks, cfg.protected_window
    if budget < sinks + window:
        raise ValueError(f"budget={budget} must be >= sinks + window = {sinks} + {window} (--kv-budget)")
    n_top = budget - sinks - window
    middle = scores[..., sinks : n - window].float()
    best = torch.sort(middle, dim=-1, descending=True, stable=True).indices[..., :n_top] + sinks
    always = torch.cat([torch.arange(sinks, device=device), torch.arange(n - window, n, device=device)])
    kept = torch.cat([always.expand(*batch_shape, sinks + window), best], dim=-1)
    return kept.sort(dim=-1).values


def reduce_heads(scores: Tensor) -> Tensor:
    """One score per slot from [..., Hkv, n] per-head scores: their plain mean (no per-head normalisation).

    Why no normalisation: every method's per-head scores already share a comparable scale (each head spreads
    the same total attention mass over the slots, R-KV's redundancy is a softmax over slots, recency is a slot
    index), and the mean ranks slots exactly like the Sparse-RL authors' SGLang, which sums scores over heads.
    Protected slots stay +inf.
    """
    return scores.mean(dim=-2)


def compress_indices(
    cfg: KVCompressConfig,
    keys: list[Tensor],
    queries: list[Tensor],
    values: list[Tensor] | None = None,
    attn_mass: list[Tensor | None] | None = None,
    budget: int | Sequence[int] | None = None,
) -> list[Tensor]:
    """Kept slots of one sequence, per layer: a LongTensor [Hkv, B_l] (sorted per head) for layer l.

    Lists hold one entry per layer (see `score_layer` for shapes). Leading batch dimensions broadcast: keys
    [..., Hkv, n, d] (e.g. the rows of an engine that compress together, every one holding the same n slots in a
    layer) give kept [..., Hkv, B_l], each entry what it would keep alone. budget: one int for every layer (uniform
    schedules only), or one per layer; None: `budgets.layer_budgets(cfg, len(keys), lengths)`, the run's schedule
    at these cache lengths.
    Granularity (cfg.granularity):
    - 'head':  every KV head of every layer selects on its own scores;
    - 'layer': one set per layer from the mean of its heads' scores (`reduce_heads`), shared by its heads;
    - 'model': one ranking for the whole model from the mean over layers of the per-layer head means (all layers
      weigh equally); layer l keeps its B_l best of it (one set for every head and layer under one budget; nested
      sets under per-layer budgets). Every layer must then hold the same n slots.
    A layer holding n <= B_l slots keeps them all ([Hkv, n], arange per head).
    """
    cfg.validate()
    n_layers = len(keys)
    if n_layers == 0:
        raise ValueError("compress_indices needs at least one layer of keys")
    budgets = _per_layer(cfg, budget, [k.shape[-2] for k in keys])
    if len(queries) != n_layers:
        raise ValueError(f"got {len(queries)} layers of queries for {n_layers} layers of keys")
    for name, per_layer in (("values", values), ("attn_mass", attn_mass)):
        if per_layer is not None and len(per_layer) != n_layers:
            raise ValueError(f"got {len(per_layer)} layers of {name} for {n_layers} layers of keys")

    scores = [
        score_layer(
            cfg,
            keys[layer],
            queries[layer],
            values[layer] if values is not None else None,
            attn_mass[layer] if attn_mass is not None else None,
        )
        for layer in range(n_layers)
    ]

    if cfg.granularity == "head":
        return [select_kept(s, b, cfg) for s, b in zip(scores, budgets)]
    if cfg.granularity == "layer":
        return [_broadcast(select_kept(reduce_heads(s), b, cfg), s.shape[-2]) for s, b in zip(scores, budgets)]
    # 'model'
    lengths = {s.shape[-1] for s in scores}
    if len(lengths) != 1:
        raise ValueError(f"--kv-granularity=model needs the same cache length in every layer, got {sorted(lengths)}")
    joint = torch.stack([reduce_heads(s) for s in scores]).mean(dim=0)
    kept = {b: select_kept(joint, b, cfg) for b in set(budgets)}
    return [_broadcast(kept[b], s.shape[-2]) for s, b in zip(scores, budgets)]


def _per_layer(cfg: KVCompressConfig, budget: int | Sequence[int] | None, lengths: list[int]) -> tuple[int, ...]:
    n_layers = len(lengths)
    if budget is None:  # kvpress's pyramid caps each layer at its cache length, as kvpress at prefill
        return layer_budgets(cfg, n_layers, lengths)
    if isinstance(budget, int):
        if cfg.schedule != "uniform":  # an engine that keeps one budget per row would silently run uniform
            raise ValueError(f"one budget ({budget}) for every layer, but --kv-budget-schedule={cfg.schedule}: pass "
                             "the per-layer budgets (budget=None takes them from the config)")
        return (budget,) * n_layers
    budgets = tuple(int(b) for b in budget)
    if len(budgets) != n_layers:
        raise ValueError(f"got {len(budgets)} budgets for {n_layers} layers of keys")
    return budgets


def _broadcast(kept: Tensor, n_kv_heads: int) -> Tensor:
    """[..., k] -> [..., Hkv, k] (a real copy: engines may index or modify it per head)."""
    return kept.unsqueeze(-2).expand(*kept.shape[:-1], n_kv_heads, kept.shape[-1]).clone()
