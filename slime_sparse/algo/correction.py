"""Sparsity correction: reweight and reject tokens sampled under a compressed KV cache.

The sampler (pi_sparse) and the dense policy the learner recomputes (pi_old) share weights but not
attention context, so their per-token probabilities differ. With the consistency ratio

    xi_t = pi_old(y_t) / pi_sparse(y_t) = exp(l_t),   l_t = logp_old_t - logp_sparse_t

every published correction of such a sampler/learner mismatch is one point of a small algebra, and each knob
of `CorrectionConfig` is one of its terms (the peer's name in brackets):

  level    the ratio a weight or a mask rule reads [verl rollout_is, slime tis_level]:
             token      xi_t
             sequence   prod_t xi_t            = exp(sum_t l_t), one value for all tokens of a sequence
             geometric  (prod_t xi_t)^(1/T)    = exp(mean_t l_t)
           the log value is clamped to +-log_ratio_clamp before exp (the peers' SAFETY_BOUND, 20).
  weight   w = the level ratio, truncated to [is_lower, is_upper] in `truncate` mode (TIS; with is_lower > 0
           slime's `clip`), left as it is in `mask` mode [verl rollout_is_threshold, slime tis_mode], and set to
           0 outside [is_lower, is_upper] in `icepop` mode (IcePop: the token keeps its place in the loss's
           denominators, it is not rejected) [verl rollout_is_threshold "lower_upper", slime icepop_function].
  mask     `mask` mode rejects the tokens (token level) or whole sequences whose level ratio lies outside
           [is_lower, is_upper] (slime's MIS); token_mask_low / token_mask_high reject single tokens by xi_t
           (the authors' code); `rs` rejects by verl's statistics of the per-token KL estimators of
           KL(pi_sparse || pi_old),  k1 = -l,  k2 = l^2 / 2,  k3 = xi - 1 - l  (l clamped as above):
             token_k{1,2,3}      the token's own value          (rejects that token)
             seq_sum_k{1,2,3}    sum over the sequence          (rejects the sequence)
             seq_mean_k{1,2,3}   mean over the sequence         (rejects the sequence; seq_mean_k1 = geometric)
             seq_max_k{2,3}      max over the sequence          (rejects the sequence)
           k2 / k3 statistics are kept while <= an upper bound; k1 statistics while exp(statistic) lies in
           [lower, upper], verl's "lower_upper" ratio bounds. NB exp(k1) = pi_sparse / pi_old = 1 / xi: verl's
           bounds are on the reciprocal of our ratio, so its "0.6_1.4" keeps xi in [1/1.4, 1/0.6].
  veto     reject a sequence if any RAW (unclamped) xi_t < seq_veto [verl's rollout_token_veto_threshold,
           slime rs_veto_threshold; Sparse-RL's eps_reject].
  OPSM     reject a sequence with advantage < 0 whose mean_t(logp_sparse - logp_old) (= seq_mean_k1, the k1
           estimate of KL(pi_sparse || pi_old)) exceeds opsm_delta [slime --use-opsm --opsm-delta; DeepSeek-V3.2].
  norm     w <- w / mean(w), the mean over every token (token level) or every sequence (sequence / geometric)
           of the ORIGINAL response mask (before any rejection), skipped when it is <= 1e-8
           [verl rollout_is_batch_normalize, slime tis_batch_normalize].
  bypass   the PPO anchor pi_old is the sampler's log-prob itself [verl bypass_mode, slime
           --use-rollout-logprobs]: the PPO ratio pi_theta / pi_sparse then does the reweighting, so no weight may
           be set; rejection rules still read xi. The pipeline applies it (pipeline.prepare_rollout); here it only
           constrains the other knobs.

Presets are named points of the algebra (correction_config.py: ours and verl's).

Conventions (same as the references): weights are defined on every original-mask token, rejection is
expressed only through the returned mask, and the loss uses both (multiply by the weight, aggregate
with the mask, which also shrinks the denominators). Metrics are taken over the original mask.
Deviation from the references, on purpose: a sequence with a non-finite log-prob (-inf, +inf or NaN, from
either policy) at any masked position is rejected whole, like a vetoed one: a sampler that reports -inf
sampled a token it gave probability 0, and NaN means a broken forward; neither can be weighed. It gets
weight 0, is left out of the batch-normalisation mean and of the xi statistics, and is counted in
"correction/nonfinite_seqs" and in the rejection rates; nothing non-finite reaches the outputs
(tests/algo/test_fuzz_objective.py holds this over thousands of adversarial batches).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .correction_config import (ALL_PRESETS, LEVELS, MODES, PRESETS, RS_OPTIONS, VERL_PRESETS, CorrectionConfig,
                                RejectionRule, parse_rejection_rules)
from .metrics import mismatch_inputs

__all__ = ["ALL_PRESETS", "LEVELS", "MODES", "PRESETS", "RS_OPTIONS", "VERL_PRESETS", "CorrectionConfig",
           "CorrectionResult", "RejectionRule", "RowVerdict", "batch_correction", "judge_rows", "kl_estimators",
           "level_log_ratio", "parse_rejection_rules", "rule_statistic", "sparsity_correction"]

# The references skip batch normalisation below this mean weight (avoids dividing by ~0).
_BATCH_NORM_MIN_MEAN = 1e-8

@dataclass
class CorrectionResult:
    """Output of `sparsity_correction`.

    weights: [B, T] detached importance weights; 0 outside the original mask and on non-finite
        sequences. Not zeroed at rejected tokens (rejection lives in `mask`), as in the references.
    mask: [B, T] float mask after token and sequence rejection; use it for the loss and its
        denominators.
    seq_kept: [B] bool, True where the sequence still has at least one token in `mask`.
    metrics: floats, see `sparsity_correction`.
    """

    weights: Tensor
    mask: Tensor
    seq_kept: Tensor
    metrics: dict[str, float]


def level_log_ratio(log_ratio: Tensor, valid: Tensor, level: str) -> Tensor:
    """[B, T] log ratio at `level`: the token's own, or its sequence's sum / mean broadcast to every token (over
    `valid` tokens; `log_ratio` must be 0 elsewhere)."""
    if level == "token":
        return log_ratio
    total = log_ratio.sum(dim=-1, keepdim=True)
    if level == "geometric":
        total = total / valid.sum(dim=-1, keepdim=True).clamp_min(1)
    return total.expand_as(log_ratio)


def kl_estimators(log_ratio: Tensor) -> dict[str, Tensor]:
    """Per-token estimators of KL(pi_sparse || pi_old) from l = log xi (samples from pi_sparse): k1 = -l,
    k2 = l^2 / 2, k3 = exp(l) - 1 - l."""
    return {"k1": -log_ratio, "k2": 0.5 * log_ratio * log_ratio, "k3": torch.expm1(log_ratio) - log_ratio}


def rule_statistic(rule: RejectionRule, estimates: dict[str, Tensor], valid: Tensor) -> Tensor:
    """[B, T] value of `rule`'s statistic at each token (a sequence's broadcast to its tokens)."""
    per_token = estimates[rule.estimator]
    per_token = torch.where(valid, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if rule.where == "token":
        return per_token
    if rule.where == "seq_max":
        seq = torch.where(valid, per_token, torch.full_like(per_token, -torch.inf)).amax(dim=-1, keepdim=True)
        seq = torch.where(valid.any(dim=-1, keepdim=True), seq, torch.zeros_like(seq))
    else:
        seq = per_token.sum(dim=-1, keepdim=True)
        if rule.where == "seq_mean":
            seq = seq / valid.sum(dim=-1, keepdim=True).clamp_min(1)
    return seq.expand_as(per_token)


def sparsity_correction(
    logp_old: Tensor,
    logp_sparse: Tensor,
    mask: Tensor,
    cfg: CorrectionConfig,
    *,
    advantages: Tensor | None = None,
    batch_norm_reduce: Callable[[Tensor], Tensor] | None = None,
) -> CorrectionResult:
    """Importance weights and rejection mask for tokens sampled from pi_sparse.

    Args:
        logp_old: [B, T] dense log-probs of the sampled tokens (pi_old).
        logp_sparse: [B, T] sampler log-probs (pi_sparse), same temperature.
        mask: [B, T] response mask (bool or 0/1 float); padding is 0.
        cfg: the correction knobs.
        advantages: [B] per-sequence advantages; needed by OPSM (--correction-opsm-delta) only.
        batch_norm_reduce: optional function applied to the tensor [sum of weights, count] (tokens at the token
            level, sequences otherwise) before the batch-normalisation mean is taken, e.g. a data-parallel
            all-reduce so the mean is global. Without it the mean is over this call's batch.

    Metrics ("correction/..."), token fractions over the original-mask tokens of finite sequences:
        seqs: sequences with >= 1 original mask token; seq_reject_rate: fraction of those without a
        kept token; token_reject_rate: 1 - kept tokens / original tokens; veto_seqs: sequences
        vetoed (finite ones); veto_seq_frac: veto_seqs / seqs (verl's rollout_is_veto_fraction); veto_token_frac:
        tokens with xi < seq_veto (verl's rollout_is_catastrophic_token_fraction); nonfinite_seqs;
        xi_mean / xi_min / xi_max: of the clamped token ratio; truncate_frac / clip_low_frac: the weight's level
        ratio above is_upper / below is_lower (truncated, rejected in mask mode, zeroed in icepop mode: their sum is
        verl's rollout_is_oob_ratio); mask_low_frac /
        mask_high_frac: xi below / above the token-mask bounds; rs_<option>_token_frac / _seq_frac: tokens /
        sequences an `rs` option rejects (verl's rollout_rs_<option>_masked_fraction / _seq_masked_fraction);
        opsm_seq_frac: sequences OPSM rejects; is_mean / is_std / is_ess: mean, standard deviation and effective
        sample size 1 / mean((w / mean w)^2) of the weights before batch normalisation, token-weighted (verl's
        rollout_is_mean / _std / _eff_sample_size); batch_norm_factor: the mean the weights were divided by (1.0
        when not applied); weight_mean: mean final weight over kept tokens.
    """
    verdict = judge_rows(logp_old, logp_sparse, mask, cfg, advantages=advantages)
    return batch_correction(verdict, cfg, batch_norm_reduce=batch_norm_reduce)


def judge_rows(logp_old: Tensor, logp_sparse: Tensor, mask: Tensor, cfg: CorrectionConfig, *,
               advantages: Tensor | None = None) -> "RowVerdict":
    """Every rule of the correction, each sequence on its own (the arguments as `sparsity_correction`'s): what the
    rows keep and their weights before batch normalisation. `batch_correction` finishes it over a batch."""
    rules = cfg.rules  # parsed once per config (a CorrectionConfig is validated when it is built)
    old, sparse, orig = mismatch_inputs(logp_old, logp_sparse, mask)
    dtype = old.dtype
    zero = torch.zeros((), dtype=dtype, device=old.device)

    # A sequence with any non-finite value at a response position cannot be judged: reject it whole.
    raw_log_xi = old - sparse
    nonfinite_seq = (orig & ~torch.isfinite(raw_log_xi)).any(dim=-1)
    valid = orig & ~nonfinite_seq[:, None]
    raw_log_xi = torch.where(valid, raw_log_xi, zero)
    clamp = cfg.log_ratio_clamp
    log_xi = raw_log_xi.clamp(-clamp, clamp)  # what weights, masks and statistics see (exp cannot overflow)
    xi = torch.exp(log_xi)

    none = torch.zeros_like(valid)
    level_ratio = torch.exp(level_log_ratio(raw_log_xi, valid, cfg.is_level).clamp(-clamp, clamp))
    if cfg.is_weight:
        above = valid & (level_ratio > cfg.is_upper) if cfg.is_upper is not None else none
        below = valid & (level_ratio < cfg.is_lower)
        if cfg.is_mode == "truncate":
            weights = level_ratio.clamp(min=cfg.is_lower, max=cfg.is_upper)
        elif cfg.is_mode == "icepop":  # out of band: weight 0, the token still counted (verl's, not a rejection)
            weights = torch.where(above | below, zero, level_ratio)
        else:
            weights = level_ratio
    else:
        weights, above, below = torch.ones_like(xi), none, none
    weights = torch.where(valid, weights, zero)

    keep = valid
    if cfg.is_mode == "mask":  # the level ratio already broadcasts a sequence's value to all its tokens
        keep = keep & ~above & ~below
    low_hit = valid & (xi < cfg.token_mask_low) if cfg.token_mask_low is not None else none
    high_hit = valid & (xi > cfg.token_mask_high) if cfg.token_mask_high is not None else none
    keep = keep & ~low_hit & ~high_hit

    rule_rejects: dict[str, Tensor] = {}
    if rules:
        estimates = kl_estimators(log_xi)
        for rule in rules:
            stat = rule_statistic(rule, estimates, valid)
            out = stat > rule.upper
            if rule.lower is not None:
                out = out | (stat < rule.lower)
            rule_rejects[rule.option] = valid & out
            keep = keep & ~rule_rejects[rule.option]

    if cfg.seq_veto is not None:
        # On the RAW log ratio: a ratio below exp(-20) must still trigger a veto at threshold < exp(-20).
        veto_token = valid & (raw_log_xi < math.log(cfg.seq_veto))
    else:
        veto_token = none
    vetoed_seq = veto_token.any(dim=-1)
    keep = keep & ~vetoed_seq[:, None]

    opsm_seq = torch.zeros_like(nonfinite_seq)
    if cfg.opsm_delta is not None:
        if advantages is None or advantages.shape != nonfinite_seq.shape:
            raise ValueError(f"{cfg.flag('opsm_delta')} needs the [B] per-sequence advantages, got "
                             f"{None if advantages is None else tuple(advantages.shape)}")
        seq_kl = -raw_log_xi.sum(dim=-1) / valid.sum(dim=-1).clamp_min(1)  # mean log(pi_sparse / pi_old)
        opsm_seq = valid.any(dim=-1) & (advantages.to(old.device) < 0) & (seq_kl > cfg.opsm_delta)
        keep = keep & ~opsm_seq[:, None]

    return RowVerdict(orig=orig, valid=valid, keep=keep, nonfinite_seq=nonfinite_seq, veto_token=veto_token,
                         vetoed_seq=vetoed_seq, opsm_seq=opsm_seq, low_hit=low_hit, high_hit=high_hit, above=above,
                      below=below, rule_rejects=rule_rejects, xi=xi, weights=weights)


def batch_correction(verdict: "RowVerdict", cfg: CorrectionConfig, *,
                     batch_norm_reduce: Callable[[Tensor], Tensor] | None = None) -> CorrectionResult:
    """The batch's part of the correction over rows judged by `judge_rows`: the weights' batch normalisation and the
    metrics (see `sparsity_correction`). No rule is evaluated again."""
    weights, valid, keep = verdict.weights, verdict.valid, verdict.keep
    dtype = weights.dtype
    zero = torch.zeros((), dtype=dtype, device=weights.device)
    norm_factor = torch.ones((), dtype=dtype, device=weights.device)
    if cfg.batch_normalize:
        if cfg.is_level == "token":
            stats = torch.stack([weights.sum(), valid.sum().to(dtype)])
        else:  # one weight per sequence: every sequence counts once, whatever its length
            has = valid.any(dim=-1)
            stats = torch.stack([torch.where(has, weights.amax(dim=-1), zero).sum(), has.sum().to(dtype)])
        if batch_norm_reduce is not None:
            stats = batch_norm_reduce(stats)
        mean_w = stats[0] / stats[1].clamp_min(1.0)
        norm_factor = torch.where(mean_w > _BATCH_NORM_MIN_MEAN, mean_w, norm_factor)
        weights = weights / norm_factor

    out_mask = keep.to(dtype)
    metrics = _correction_metrics(verdict, weights, norm_factor)
    return CorrectionResult(weights=weights.detach(), mask=out_mask, seq_kept=verdict.seq_kept, metrics=metrics)


@dataclass
class RowVerdict:
    """What the correction decides for each sequence on its own ([B, T] tokens, [B] sequences): every rule, the
    weights before batch normalisation. No batch statistic enters it, so rows judged in different calls (the rounds
    of dynamic sampling) can be selected and joined (`take`) and finished as one batch (`batch_correction`)."""

    orig: Tensor
    valid: Tensor
    keep: Tensor
    nonfinite_seq: Tensor
    veto_token: Tensor
    vetoed_seq: Tensor
    opsm_seq: Tensor
    low_hit: Tensor
    high_hit: Tensor
    above: Tensor
    below: Tensor
    rule_rejects: dict[str, Tensor]
    xi: Tensor  # the clamped token ratio (1 outside `valid`)
    weights: Tensor  # before batch normalisation (0 outside `valid`)

    @property
    def seq_kept(self) -> Tensor:
        """[B] True where the sequence keeps at least one token."""
        return self.keep.any(dim=-1)

    @staticmethod
    def take(parts: "list[tuple[RowVerdict, list[int]]]", width: int) -> "RowVerdict":
        """The rows `rows` of each verdict, in order, joined into one of `width` token columns (the batch's longest
        response: what judging them together would have padded to)."""
        def pick(name: str, tensors: list[Tensor]) -> Tensor:
            pad = 1.0 if name == "xi" else 0
            cols = [t if t.dim() == 1 else torch.nn.functional.pad(t[:, :width], (0, max(0, width - t.shape[1])),
                                                                   value=pad) for t in tensors]
            return torch.cat(cols)

        chosen = [(v, torch.tensor(rows, dtype=torch.long)) for v, rows in parts]
        fields = {}
        for f in dataclasses.fields(RowVerdict):
            if f.name == "rule_rejects":
                fields[f.name] = {k: pick(k, [v.rule_rejects[k].index_select(0, i) for v, i in chosen])
                                  for k in (chosen[0][0].rule_rejects if chosen else {})}
            else:
                fields[f.name] = pick(f.name, [getattr(v, f.name).index_select(0, i) for v, i in chosen])
        return RowVerdict(**fields)


def _correction_metrics(c: RowVerdict, weights: Tensor, norm_factor: Tensor) -> dict[str, float]:
    xi, raw_weights = c.xi, c.weights
    f = xi.dtype
    has_tokens = c.orig.any(dim=-1)
    n_seqs = has_tokens.sum().to(f)
    n_orig = c.orig.sum().to(f)
    n_valid = c.valid.sum().to(f)
    n_keep = c.keep.sum().to(f)

    def frac(num: Tensor, den: Tensor) -> Tensor:
        return num.to(f) / den.clamp_min(1.0)

    def mean(x: Tensor) -> Tensor:  # over valid tokens
        return frac((x * c.valid).sum(), n_valid)

    any_valid = n_valid > 0
    one = torch.ones((), dtype=f, device=xi.device)
    xi_min = torch.where(c.valid, xi, torch.full_like(xi, torch.inf)).min() if xi.numel() else one
    xi_max = torch.where(c.valid, xi, torch.full_like(xi, -torch.inf)).max() if xi.numel() else one
    is_mean = mean(raw_weights)
    second = mean(raw_weights * raw_weights)
    # ESS fraction (sum w)^2 / (n sum w^2) = mean(w)^2 / mean(w^2); 1 for equal weights or no tokens
    is_ess = torch.where(second > 0, is_mean * is_mean / second.clamp_min(torch.finfo(f).tiny), one)

    values = {
        "correction/seqs": n_seqs,
        "correction/seq_reject_rate": frac((has_tokens & ~c.seq_kept).sum(), n_seqs),
        "correction/token_reject_rate": frac(n_orig - n_keep, n_orig),
        "correction/veto_seqs": (c.vetoed_seq & ~c.nonfinite_seq).sum().to(f),
        "correction/veto_seq_frac": frac((c.vetoed_seq & ~c.nonfinite_seq).sum(), n_seqs),
        "correction/veto_token_frac": frac(c.veto_token.sum(), n_valid),
        "correction/nonfinite_seqs": (c.nonfinite_seq & has_tokens).sum().to(f),
        # Empty batch: report the neutral ratio 1 rather than NaN / inf.
        "correction/xi_mean": torch.where(any_valid, mean(xi), one),
        "correction/xi_min": torch.where(any_valid, xi_min, one),
        "correction/xi_max": torch.where(any_valid, xi_max, one),
        "correction/truncate_frac": frac(c.above.sum(), n_valid),
        "correction/clip_low_frac": frac(c.below.sum(), n_valid),
        "correction/mask_low_frac": frac(c.low_hit.sum(), n_valid),
        "correction/mask_high_frac": frac(c.high_hit.sum(), n_valid),
        "correction/opsm_seq_frac": frac(c.opsm_seq.sum(), n_seqs),
        "correction/is_mean": torch.where(any_valid, is_mean, one),
        "correction/is_std": (second - is_mean * is_mean).clamp_min(0.0).sqrt(),
        "correction/is_ess": is_ess,
        "correction/batch_norm_factor": norm_factor,
        "correction/weight_mean": frac((weights * c.keep).sum(), n_keep),
    }
    for option, rejected in c.rule_rejects.items():
        values[f"correction/rs_{option}_token_frac"] = frac(rejected.sum(), n_valid)
        values[f"correction/rs_{option}_seq_frac"] = frac(rejected.any(dim=-1).sum(), n_seqs)
    # One device->host transfer for all of them.
    floats = torch.stack([v.to(f).reshape(()) for v in values.values()]).tolist()
    return dict(zip(values.keys(), floats))
