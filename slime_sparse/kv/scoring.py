"""Token scores of a KV-compression method, checked at the boundary: one entry point over the registered methods.

The methods themselves are classes in `methods/` (one module each: what it scores, its knobs, what it needs);
the tensor operations they share are in `ops.py`. Shapes and conventions: `ops.py`.
Sinks and the last `cfg.protected_window` slots (the window, unless the preset protects none) carry +inf
(`ops.PROTECTED_SCORE`); selection protects them in any case.

Where each method reduces GQA groups (read from the reference code, matched on purpose):
- rkv: on the attention *logits*, before the softmax, as R-KV's `compute_attention_scores` does (R-KV and the
  Sparse-RL authors' SGLang use `max`);
- snapkv / h2o: on the per-query-head scores after the window sum (and pooling), as kvpress's SnapKVPress does.
"""
from __future__ import annotations

from torch import Tensor

from .config import KVCompressConfig


def needs_queries(method, has_mass: bool) -> bool:
    """Whether scoring `method` (a KV method: its `needs_queries` / `tracks_mass` traits) reads the sequence's last
    observed queries: it scores with them, or it scores with the attention mass and the engine tracks none
    (`has_mass` False: the mass is then taken from the queries). The one statement of the rule (the engine's
    compressor asks it too)."""
    return method.needs_queries or (method.tracks_mass and not has_mass)


def check_inputs(
    cfg: KVCompressConfig, keys: Tensor, queries: Tensor, values: Tensor | None, attn_mass: Tensor | None
) -> None:
    if keys.dim() < 3:
        raise ValueError(f"keys must be [..., Hkv, n, d], got shape {tuple(keys.shape)}")
    if queries.dim() != keys.dim() or queries.shape[:-3] != keys.shape[:-3]:
        raise ValueError(f"queries must be [..., Hq, w, d] with the keys' leading dims {tuple(keys.shape[:-3])}, "
                         f"got shape {tuple(queries.shape)}")
    n_kv_heads, n, head_dim = keys.shape[-3:]
    n_q_heads, w, q_dim = queries.shape[-3:]
    if q_dim != head_dim:
        raise ValueError(f"queries head dim {q_dim} != keys head dim {head_dim}")
    if n_kv_heads < 1 or n_q_heads % n_kv_heads != 0:
        raise ValueError(f"queries have {n_q_heads} heads, not a multiple of keys' {n_kv_heads} KV heads")
    if w > cfg.window:
        raise ValueError(f"queries hold {w} tokens, more than --kv-window={cfg.window}")
    if w > n:
        raise ValueError(f"queries hold {w} tokens but the cache only {n}")
    if needs_queries(cfg.traits, has_mass=attn_mass is not None) and w == 0:
        raise ValueError(f"--kv-method={cfg.method} needs at least one observed query, got w=0")
    if values is not None and values.shape[:-1] != keys.shape[:-1]:
        raise ValueError(f"values shape {tuple(values.shape)} does not match keys shape {tuple(keys.shape)}")
    if attn_mass is not None and attn_mass.shape != keys.shape[:-1]:
        raise ValueError(f"attn_mass must be [..., Hkv, n] = {tuple(keys.shape[:-1])}, got {tuple(attn_mass.shape)}")


def score_layer(
    cfg: KVCompressConfig,
    keys: Tensor,
    queries: Tensor,
    values: Tensor | None = None,
    attn_mass: Tensor | None = None,
) -> Tensor:
    """Scores of every cache slot of one layer of one sequence: [Hkv, n] float32, higher = keep.

    keys [Hkv, n, d] and queries [Hq, w, d] (w <= cfg.window, the last query at slot n - 1) are post-RoPE.
    values are accepted for interface stability; no method here uses them. attn_mass [Hkv, n] (H2O only) is the
    attention mass accumulated by the engine, already summed over each group's query heads.
    Sinks and window slots carry +inf (see module docstring); `select_kept` protects them in any case.

    Leading batch dimensions broadcast (keys [..., Hkv, n, d], queries [..., Hq, w, d], attn_mass [..., Hkv, n]
    -> [..., Hkv, n]), e.g. rows x layers of one engine step, provided every entry holds the same n slots and w
    queries: a batch entry's scores equal that entry scored alone.
    """
    scorer = cfg.scorer  # raises for --kv-method none
    check_inputs(cfg, keys, queries, values, attn_mass)
    return scorer.score(keys, queries, attn_mass)
