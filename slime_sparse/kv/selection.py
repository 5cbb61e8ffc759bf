"""Which cache slots survive a compression: top-k under protection of sinks and window, per head / layer / model.

`choose_slots` is the batched core every engine calls (layers x rows of one step at once); `compress_indices` is the
per-layer list interface over it; `select_kept` the top-k of one score tensor.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .budgets import layer_budgets
from .config import KVCompressConfig
from .scoring import check_inputs


def ranking_keys(scores: Tensor) -> Tensor:
    """int64 keys ordering slots like a stable descending sort of `scores` [..., m]: higher score first, ties to the
    earlier slot. The float's bits, made monotone, in the high word and the reversed slot in the low word, so one
    top-k over the keys picks the set a stable sort would, on any device (torch.topk alone breaks ties freely)."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0: they tie, as in a sort
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # negative floats: reverse their order
    slot = torch.arange(scores.shape[-1], device=scores.device)
    return ordered * (1 << 32) + ((1 << 32) - 1 - slot)


def select_kept(scores: Tensor, budget: int, cfg: KVCompressConfig) -> Tensor:
    """Sorted LongTensor [..., budget] of kept slots, from scores [..., n] (higher = keep).

    Always the first cfg.sinks and the last cfg.protected_window slots (the window, unless the preset protects none),
    plus the (budget - sinks - window) best-scored
    slots between them; ties go to the earlier slot (`ranking_keys`), so selection is deterministic on every device.
    If n <= budget nothing is dropped: arange(n) for every row. Scores of the middle slots must not be NaN.
    """
    return _select(scores, budget, cfg.sinks, cfg.protected_window)


def _select(scores: Tensor, budget: int, sinks: int, window: int) -> Tensor:
    n = scores.shape[-1]
    device = scores.device
    if n <= budget:
        return torch.arange(n, device=device).expand(*scores.shape[:-1], n).clone()
    if budget < sinks + window:
        raise ValueError(f"budget={budget} must be >= sinks + window = {sinks} + {window} (--kv-budget)")
    best = ranking_keys(scores[..., sinks : n - window]).topk(budget - sinks - window, dim=-1, sorted=False).indices
    always = torch.cat([torch.arange(sinks, device=device), torch.arange(n - window, n, device=device)])
    kept = torch.cat([always.expand(*scores.shape[:-1], sinks + window), best + sinks], dim=-1)
    return kept.sort(dim=-1).values


def reduce_heads(scores: Tensor) -> Tensor:
    """One score per slot from [..., Hkv, n] per-head scores: their plain mean (no per-head normalisation).

    Why no normalisation: every method's per-head scores already share a comparable scale (each head spreads
    the same total attention mass over the slots, R-KV's redundancy is a softmax over slots, recency is a slot
    index), and the mean ranks slots exactly like the Sparse-RL authors' SGLang, which sums scores over heads.
    Protected slots stay +inf.
    """
    return scores.mean(dim=-2)


def shares_selection(cfg: KVCompressConfig) -> tuple[bool, bool]:
    """(every KV head of a layer keeps the same slots, every layer keeps the same slots): what a compression's result
    and its eviction record need to store once."""
    position_only = cfg.traits.position_only  # its scores are the same in every head and layer
    one_budget = cfg.schedule == "uniform"
    return (cfg.granularity != "head" or position_only,
            cfg.granularity == "model" or (position_only and one_budget))


def choose_slots(cfg: KVCompressConfig, scores: Tensor, budgets: Sequence[int]) -> Tensor:
    """The batched core: kept slots from scores [L, ..., Hkv, n] of L layers holding n slots each (any leading dims,
    e.g. the rows of one engine step), layer l keeping min(n, budgets[l]).

    Returns [L', ..., H', W], sorted, W = min(n, max budget), L' = 1 when every layer keeps the same slots and H' = 1
    when every head does (`shares_selection`); a layer keeping fewer than W repeats its last slot up to W (a set of
    slots read as a mask or gathered twice is unchanged).
    Granularity (cfg.granularity):
    - 'head':  every KV head of every layer selects on its own scores;
    - 'layer': one set per layer from the mean of its heads' scores (`reduce_heads`), shared by its heads;
    - 'model': one ranking for the whole model from the mean over layers of the per-layer head means (all layers
      weigh equally): one set for every head and layer (one budget).
    """
    shared_heads, shared_layers = shares_selection(cfg)
    if shared_heads:
        scores = reduce_heads(scores).unsqueeze(-2)
    if shared_layers:
        scores = scores.mean(dim=0, keepdim=True)
        budgets = budgets[:1]
    sinks, window = cfg.sinks, cfg.protected_window
    if len(set(budgets)) == 1:
        return _select(scores, budgets[0], sinks, window)
    width = min(scores.shape[-1], max(budgets))
    return torch.stack([_pad(_select(s, b, sinks, window), width) for s, b in zip(scores, budgets)])


def _pad(kept: Tensor, width: int) -> Tensor:
    return kept if kept.shape[-1] == width else torch.cat(
        [kept, kept[..., -1:].expand(*kept.shape[:-1], width - kept.shape[-1])], dim=-1)


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
    at these cache lengths (kvpress's pyramid caps each layer at its length, as kvpress does at prefill).
    Layers of equal length are scored in one batched call; granularity as in `choose_slots` ('model' needs the same
    n in every layer). A layer holding n <= B_l slots keeps them all ([Hkv, n], arange per head).
    """
    n_layers = len(keys)
    if n_layers == 0:
        raise ValueError("compress_indices needs at least one layer of keys")
    budgets = _per_layer(cfg, budget, [k.shape[-2] for k in keys])
    if len(queries) != n_layers:
        raise ValueError(f"got {len(queries)} layers of queries for {n_layers} layers of keys")
    for name, per_layer in (("values", values), ("attn_mass", attn_mass)):
        if per_layer is not None and len(per_layer) != n_layers:
            raise ValueError(f"got {len(per_layer)} layers of {name} for {n_layers} layers of keys")
    masses = attn_mass if attn_mass is not None else [None] * n_layers
    scorer = cfg.scorer
    for layer in range(n_layers):
        check_inputs(cfg, keys[layer], queries[layer], values[layer] if values is not None else None, masses[layer])
    shapes = {(k.shape, q.shape, m is None) for k, q, m in zip(keys, queries, masses)}
    if len(shapes) == 1:  # one batched call over every layer
        mass = None if masses[0] is None else torch.stack(masses)
        kept = choose_slots(cfg, scorer.score(torch.stack(keys), torch.stack(queries), mass), budgets)
        per_layer = [kept[min(layer, kept.shape[0] - 1)] for layer in range(n_layers)]
    else:
        if cfg.granularity == "model":
            lengths = sorted({k.shape[-2] for k in keys})
            raise ValueError(f"--kv-granularity=model needs the same cache length in every layer, got {lengths}")
        per_layer = [choose_slots(cfg, scorer.score(k, q, m)[None], (b,))[0]
                     for k, q, m, b in zip(keys, queries, masses, budgets)]
    out = []
    for layer, kept in enumerate(per_layer):
        n_kv_heads, n = keys[layer].shape[-3], keys[layer].shape[-2]
        kept = kept[..., : min(n, budgets[layer])]
        out.append(kept.expand(*kept.shape[:-2], n_kv_heads, kept.shape[-1]).clone())
    return out


def _per_layer(cfg: KVCompressConfig, budget: int | Sequence[int] | None, lengths: list[int]) -> tuple[int, ...]:
    n_layers = len(lengths)
    if budget is None:
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
