"""Diagnostics of the sampler/learner mismatch and of KV-cache savings.

Notation: tokens y_t were sampled from pi_sparse (compressed cache); pi_old is the dense recompute;
log xi_t = logp_old_t - logp_sparse_t.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

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


def quantile(values: Tensor, q: float) -> Tensor:
    """The q-quantile of a 1-D tensor, linearly interpolated between order statistics (numpy's and torch.quantile's
    default); 0 for an empty one. A sort, so no size limit (torch.quantile stops at 2^24 elements)."""
    if values.numel() == 0:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    ordered = values.flatten().sort().values
    pos = q * (ordered.numel() - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, ordered.numel() - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def log_ratio_stats(log_ratio: Tensor, valid: Tensor, *, token_bounds: tuple[float | None, float | None] = (0.5, 1.5),
                    veto: float = 1e-4) -> dict[str, Tensor]:
    """The statistics every mismatch part is logged with, from a per-token log ratio l = log(p / q) of the sampled
    tokens (q: the policy that sampled them) over the `valid` [B, T] tokens (`log_ratio` finite there). For the
    total, p / q = xi = pi_old / pi_sparse; for a part of it, that part's ratio.

        k1            mean(-l)                     KL(q || p), k1 estimator
        k3            mean(e^l - 1 - l)            the same KL, k3 estimator (>= 0, lower variance)
        abs_log_xi    mean |l|                     slime's train_rollout_logprob_abs_diff, token mean
        abs_log_xi_p99, abs_log_xi_p999            99th / 99.9th percentile of |l| (the tail a mask acts on)
        xi_p5         5th percentile of e^l        Sparrow's tail statistic (stable runs keep it >= 0.86)
        chi2_token    mean(e^{2l}) - 1             chi^2(p || q) per token
        chi2_seq      mean over sequences of e^{2 sum_t l} - 1
        token_mask_frac   share of tokens with e^l outside `token_bounds` (what that token mask would reject)
        veto_seq_frac     share of sequences with some e^l < `veto` (what that veto would reject)
    l is clamped to [-20, 20] before exp (the sum of a sequence after summing), so one absurd token cannot make
    a metric inf; the veto reads the raw l. With no valid token every value is 0."""
    f = log_ratio.dtype
    zero = torch.zeros((), dtype=f, device=log_ratio.device)
    l = torch.where(valid, log_ratio, zero)  # noqa: E741
    n = valid.sum().to(f)

    def mean(x: Tensor) -> Tensor:
        return torch.where(valid, x, zero).sum() / n.clamp_min(1.0)

    lc = l.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(lc)
    seq_has = valid.any(dim=-1)
    n_seq = seq_has.sum().to(f)
    chi2_seq_each = torch.exp(2.0 * l.sum(dim=-1).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)) - 1.0
    low, high = token_bounds
    outside = torch.zeros_like(valid)
    if low is not None:
        outside = outside | (ratio < low)
    if high is not None:
        outside = outside | (ratio > high)
    vetoed = (valid & (l < math.log(veto))).any(dim=-1)
    abs_l = l.abs()[valid]
    return {
        "k1": mean(-l),
        "k3": mean(ratio - 1.0 - lc),
        "abs_log_xi": mean(l.abs()),
        "abs_log_xi_p99": quantile(abs_l, 0.99),
        "abs_log_xi_p999": quantile(abs_l, 0.999),
        "xi_p5": quantile(ratio[valid], 0.05),
        "chi2_token": torch.where(n > 0, mean(ratio * ratio) - 1.0, zero),
        "chi2_seq": torch.where(seq_has, chi2_seq_each, zero).sum() / n_seq.clamp_min(1.0),
        "token_mask_frac": mean(outside.to(f)),
        "veto_seq_frac": vetoed.sum().to(f) / n_seq.clamp_min(1.0),
    }


def _floats(values: dict[str, Tensor], prefix: str) -> dict[str, float]:
    floats = torch.stack([v.reshape(()).to(torch.float64) for v in values.values()]).tolist()  # one transfer
    return {prefix + k: x for k, x in zip(values.keys(), floats)}


def mismatch_metrics(logp_old: Tensor, logp_sparse: Tensor, mask: Tensor, *,
                     token_bounds: tuple[float | None, float | None] = (0.5, 1.5), veto: float = 1e-4
                     ) -> dict[str, float]:
    """How far the sampler (pi_sparse) is from the dense policy (pi_old) on the sampled tokens.

    Token statistics over the positions where `mask` > 0 and both log-probs are finite; other positions
    (padding, non-finite tokens) are ignored and the count of masked non-finite ones is reported. With no
    usable token every statistic is 0 (perplexities 1).

        mismatch/<stat>      `log_ratio_stats` of log xi = logp_old - logp_sparse: k1, k3, abs_log_xi, its p99
                             and p99.9, xi_p5, chi2_token, chi2_seq (as slime logs it), token_mask_frac,
                             veto_seq_frac (`token_bounds`, `veto`: the run's, see CorrectionConfig.diagnostic_bounds)
        mismatch/sampler_ppl exp(-mean logp_sparse)
        mismatch/learner_ppl exp(-mean logp_old)
        mismatch/tokens, mismatch/nonfinite_tokens

    Sums are taken in float64 (finite log-probs of any float32 magnitude add up without overflow) and the
    perplexities saturate at exp(700).
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
    values = log_ratio_stats(old - sparse, valid, token_bounds=token_bounds, veto=veto)
    values.update({
        "sampler_ppl": torch.exp((-sparse.sum() / n.clamp_min(1.0)).clamp(max=_MAX_LOG_PPL)),
        "learner_ppl": torch.exp((-old.sum() / n.clamp_min(1.0)).clamp(max=_MAX_LOG_PPL)),
        "tokens": n,
        "nonfinite_tokens": (on & ~finite).sum().to(f),
    })
    return _floats(values, "mismatch/")


def mismatch_split_metrics(logp_old: Tensor, logp_shadow: Tensor, logp_sparse: Tensor, mask: Tensor, *,
                           token_bounds: tuple[float | None, float | None] = (0.5, 1.5), veto: float = 1e-4
                           ) -> dict[str, float]:
    """The mismatch split in its two parts, per token:

        log xi = [logp_old - logp_shadow] + [logp_shadow - logp_sparse]
                  sparsity: what the eviction    numeric: the learner's recompute under the sampler's own
                  changes (dense vs shadow)      eviction mask vs the sampler itself (kernels, precision)

    each part logged with `log_ratio_stats` as mismatch/sparsity/<stat> and mismatch/numeric/<stat> (the total is
    mismatch/<stat>, `mismatch_metrics`), over the masked tokens where all three log-probs are finite. k1 adds up:
    k1 = sparsity k1 + numeric k1 over the same tokens; the other statistics do not (they are not linear)."""
    if not (logp_shadow.shape == logp_old.shape):
        raise ValueError(f"logp_shadow must have shape {tuple(logp_old.shape)}, got {tuple(logp_shadow.shape)}")
    old, sparse, on = mismatch_inputs(logp_old, logp_sparse, mask)
    shadow = logp_shadow.detach().to(old.dtype)
    old, shadow, sparse = old.double(), shadow.double(), sparse.double()
    valid = on & torch.isfinite(old) & torch.isfinite(shadow) & torch.isfinite(sparse)
    zero = torch.zeros((), dtype=old.dtype, device=old.device)
    part = lambda a, b: torch.where(valid, a - b, zero)  # noqa: E731
    kw = dict(token_bounds=token_bounds, veto=veto)
    return {**_floats(log_ratio_stats(part(old, shadow), valid, **kw), "mismatch/sparsity/"),
            **_floats(log_ratio_stats(part(shadow, sparse), valid, **kw), "mismatch/numeric/")}


def mismatch_staleness_metrics(logp_old: Tensor, logp_then: Tensor, mask: Tensor, *,
                               token_bounds: tuple[float | None, float | None] = (0.5, 1.5), veto: float = 1e-4
                               ) -> dict[str, float]:
    """Under --async, the part of the mismatch the weights' move made: l = logp_old - logp_then per token, pi_old
    the learner's dense recompute now, pi_then the dense policy of the weights that sampled (the sampler's version),
    logged with `log_ratio_stats` as mismatch/staleness/<stat> over the masked tokens where both are finite. The rest
    of log xi, logp_then - logp_sparse, is the mismatch a synchronous run would have (sparsity + numeric)."""
    old, then, on = mismatch_inputs(logp_old, logp_then, mask)
    valid = on & torch.isfinite(old) & torch.isfinite(then)
    diff = torch.where(valid, old.double() - then.double(), torch.zeros((), dtype=torch.float64, device=old.device))
    return _floats(log_ratio_stats(diff, valid, token_bounds=token_bounds, veto=veto), "mismatch/staleness/")


@dataclass(frozen=True)
class Alarm:
    """A documented alarm on a logged metric: it fires when the value leaves [low, high]."""

    key: str
    low: float
    high: float
    source: str  # who documents it

    def crossed(self, value: float) -> bool:
        return not (self.low <= value <= self.high)

    def describe(self, value: float) -> str:
        bounds = (f"outside [{self.low:g}, {self.high:g}]" if math.isfinite(self.low) and math.isfinite(self.high)
                  else f"< {self.low:g}" if math.isfinite(self.low) else f"> {self.high:g}")
        return f"{self.key} = {value:.4g} is {bounds} ({self.source})"


# The alarms the peers document on these statistics (verl's rollout-correction troubleshooting guide, slime's CI,
# Sparrow's paper); the training loop prints each the first time a rollout crosses it.
MISMATCH_ALARMS: tuple[Alarm, ...] = (
    Alarm("correction/is_mean", 0.5, 2.0, "verl: the IS weights' mean should stay near 1"),
    Alarm("correction/is_ess", 0.3, math.inf, "verl: effective sample size of the IS weights"),
    Alarm("correction/veto_seq_frac", -math.inf, 0.1, "verl: share of sequences the veto rejects"),
    Alarm("mismatch/chi2_token", -math.inf, 1.0, "verl: per-token chi-square of pi_old against pi_sparse"),
    Alarm("mismatch/k1", -0.1, 0.1, "verl: |KL| of the sampler against the learner"),
    Alarm("mismatch/abs_log_xi", -math.inf, 0.1, "slime's CI bound on train_rollout_logprob_abs_diff"),
    Alarm("mismatch/xi_p5", 0.86, math.inf, "Sparrow keeps the 5th percentile of pi_old / pi_sparse >= 0.86"),
)


def crossed_alarms(metrics: Mapping[str, float]) -> list[tuple[str, str]]:
    """(key, description) of every alarm that `metrics` (one rollout's) crosses."""
    return [(a.key, a.describe(metrics[a.key])) for a in MISMATCH_ALARMS
            if a.key in metrics and math.isfinite(metrics[a.key]) and a.crossed(metrics[a.key])]


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
