"""Diagnostics of the sampler/learner mismatch and of KV-cache savings.

Notation: tokens y_t were sampled from pi_sparse (compressed cache); pi_old is the dense recompute;
log xi_t = logp_old_t - logp_sparse_t.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from slime_sparse.types import KVStats

# exp() guard for the ratio moments, the same bound slime's mismatch metrics use.
_LOG_RATIO_CLAMP = 20.0
# Perplexities saturate at exp(700) (~1e304, float64's range) instead of overflowing to inf: a mean
# log-prob below -700 comes only from a broken engine, and one such batch must not make the metric inf.
_MAX_LOG_PPL = 700.0


def mismatch_inputs(logp_old: Tensor, logp_sparse: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(pi_old, pi_sparse) log-probs detached in a float dtype of at least 32 bits, and the bool mask; ValueError
    unless all three share one [B, T] shape. The inputs of everything that compares the two policies."""
    if not (logp_old.shape == logp_sparse.shape == mask.shape) or mask.dim() != 2:
        raise ValueError(
            "logp_old, logp_sparse and mask must share one [B, T] shape, got "
            f"{tuple(logp_old.shape)}, {tuple(logp_sparse.shape)}, {tuple(mask.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(logp_old.dtype, logp_sparse.dtype), torch.float32)
    return logp_old.detach().to(dtype), logp_sparse.detach().to(dtype), mask > 0


def mismatch_metrics(logp_old: Tensor, logp_sparse: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the sampler (pi_sparse) is from the dense policy (pi_old) on the sampled tokens.

    All means are token means over the positions where `mask` > 0 and both log-probs are finite;
    other positions (padding, rejected or non-finite tokens) are ignored and the count of masked
    non-finite ones is reported. With no usable token every mean is taken as 0 (perplexities 1).

        mismatch/k1          mean(-log xi)                  KL(pi_sparse || pi_old), k1 estimator
        mismatch/k3          mean(xi - 1 - log xi)          same KL, k3 estimator (>= 0, lower variance)
        mismatch/abs_log_xi  mean(|log xi|)
        mismatch/chi2_token  mean(xi^2) - 1                 chi^2(pi_old || pi_sparse) per token
        mismatch/chi2_seq    mean_seq exp(2 * clamp(sum_t log xi, -20, 20)) - 1
                                                            chi^2 of the whole-sequence ratio, as slime
                                                            logs it; over sequences with a usable token
        mismatch/sampler_ppl exp(-mean logp_sparse)
        mismatch/learner_ppl exp(-mean logp_old)
        mismatch/tokens, mismatch/nonfinite_tokens

    In k3 and chi2_token, log xi is clamped to [-20, 20] before exp so one absurd token cannot make
    the metric inf; sums are taken in float64 (finite log-probs of any float32 magnitude add up without
    overflow) and the perplexities saturate at exp(700).
    """
    old, sparse, on = mismatch_inputs(logp_old, logp_sparse, mask)
    old, sparse = old.double(), sparse.double()
    f = old.dtype
    finite = torch.isfinite(old) & torch.isfinite(sparse)
    valid = on & finite
    zero = torch.zeros((), dtype=f, device=old.device)
    old = torch.where(valid, old, zero)
    sparse = torch.where(valid, sparse, zero)
    n = valid.sum().to(f)

    def mean(x: Tensor) -> Tensor:
        return torch.where(valid, x, zero).sum() / n.clamp_min(1.0)

    log_xi = old - sparse
    log_xi_c = log_xi.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    xi_c = torch.exp(log_xi_c)

    seq_has = valid.any(dim=-1)
    seq_log_ratio = log_xi.sum(dim=-1).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    chi2_seq_each = torch.exp(2.0 * seq_log_ratio) - 1.0
    n_seq = seq_has.sum().to(f)
    chi2_seq = torch.where(seq_has, chi2_seq_each, zero).sum() / n_seq.clamp_min(1.0)

    has_tokens = n > 0
    values = {
        "mismatch/k1": mean(-log_xi),
        "mismatch/k3": mean(xi_c - 1.0 - log_xi_c),
        "mismatch/abs_log_xi": mean(log_xi.abs()),
        "mismatch/chi2_token": torch.where(has_tokens, mean(xi_c * xi_c) - 1.0, zero),
        "mismatch/chi2_seq": chi2_seq,
        "mismatch/sampler_ppl": torch.exp((-mean(sparse)).clamp(max=_MAX_LOG_PPL)),
        "mismatch/learner_ppl": torch.exp((-mean(old)).clamp(max=_MAX_LOG_PPL)),
        "mismatch/tokens": n,
        "mismatch/nonfinite_tokens": (on & ~finite).sum().to(f),
    }
    floats = torch.stack([v.reshape(()) for v in values.values()]).tolist()
    return dict(zip(values.keys(), floats))


def kv_metrics(stats: Sequence[KVStats]) -> dict[str, float]:
    """KV-cache accounting over a batch of generated sequences.

        kv/savings           1 - sum(kept_kv_tokens) / sum(dense_kv_tokens)   (token-steps saved;
                             0 when nothing was decoded)
        kv/dense_tokens      sum of dense_kv_tokens;  kv/kept_tokens  sum of kept_kv_tokens
        kv/peak_tokens_max   max peak_kv_tokens;      kv/peak_tokens_mean  its mean
        kv/compressions_mean mean number of compressions per sequence
    Sums (not a mean of per-sequence savings) so long sequences weigh by the memory they use.
    """
    n = len(stats)
    dense = sum(s.dense_kv_tokens for s in stats)
    kept = sum(s.kept_kv_tokens for s in stats)
    peaks = [s.peak_kv_tokens for s in stats]
    return {
        "kv/savings": 1.0 - kept / dense if dense > 0 else 0.0,
        "kv/dense_tokens": float(dense),
        "kv/kept_tokens": float(kept),
        "kv/peak_tokens_max": float(max(peaks)) if n else 0.0,
        "kv/peak_tokens_mean": sum(peaks) / n if n else 0.0,
        "kv/compressions_mean": sum(s.compressions for s in stats) / n if n else 0.0,
    }


def shadow_metrics(logp_shadow: Tensor, logp_sparse: Tensor, mask: Tensor) -> dict[str, float]:
    """How exactly the learner's shadow recompute (pi_shadow, under the sampler's eviction record) reproduces
    the sampler (pi_sparse) on the sampled tokens: ~0 up to numerics (fp32 ~1e-6; bf16 kernels more).

        shadow/abs_diff_mean, shadow/abs_diff_max   |logp_shadow - logp_sparse| over the masked tokens
        shadow/k3                                   mean(exp(d) - 1 - d), d = logp_shadow - logp_sparse
    """
    shadow, sparse, on = mismatch_inputs(logp_shadow, logp_sparse, mask)
    d = torch.where(on, shadow - sparse, torch.zeros((), dtype=shadow.dtype))
    n = on.sum().clamp_min(1)
    k3 = torch.where(on, torch.exp(d.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)) - 1 - d, torch.zeros_like(d))
    return {
        "shadow/abs_diff_mean": float(d.abs().sum() / n),
        "shadow/abs_diff_max": float(d.abs().max()) if bool(on.any()) else 0.0,
        "shadow/k3": float(k3.sum() / n),
    }
