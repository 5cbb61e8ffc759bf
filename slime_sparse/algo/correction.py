"""Sparsity correction: reweight and reject tokens sampled under a compressed KV cache.

The sampler (pi_sparse) and the dense policy the learner recomputes (pi_old) share weights but not
attention context, so their per-token probabilities differ. With the consistency ratio

    xi_t = pi_old(y_t) / pi_sparse(y_t) = exp(logp_old_t - logp_sparse_t)

Sparse-RL (arXiv 2601.10079) corrects the policy gradient by
  * importance weighting: multiply each token's PPO term by xi_t (outside the PPO clip);
  * rejection: drop tokens / whole sequences whose xi shows the sample is implausible under pi_old.

Every knob is explicit in `CorrectionConfig`; presets reproduce the two published settings:

  none   weights 1, nothing rejected (plain GRPO on sparse rollouts).
  paper  the paper's rule: w = xi, reject a sequence if any xi_t < 1e-4.
  mis    the authors' released code (slime's mismatch helper, "truncate" mode, mis.yaml):
           w_t   = min(exp(clamp(log xi_t, -20, 20)), 1.5)
           token kept only if 0.5 <= exp(clamp(log xi_t, -20, 20)) <= 1.5
           sequence vetoed if any RAW log xi_t < log(1e-4)
           w <- w / mean(w), the mean over every token of the ORIGINAL response mask (before any
           rejection), skipped when that mean <= 1e-8.

Conventions (same as the reference): weights are defined on every original-mask token, rejection is
expressed only through the returned mask, and the loss uses both (multiply by the weight, aggregate
with the mask, which also shrinks the denominators). Metrics are taken over the original mask.
Deviation from the reference, on purpose: a sequence with a non-finite log-prob (-inf, +inf or NaN, from
either policy) at any masked position is rejected whole, like a vetoed one: a sampler that reports -inf
sampled a token it gave probability 0, and NaN means a broken forward; neither can be weighed. It gets
weight 0, is left out of the batch-normalisation mean and of the xi statistics, and is counted in
"correction/nonfinite_seqs" and in the rejection rates; nothing non-finite reaches the outputs
(tests/test_fuzz_objective.py holds this over thousands of adversarial batches).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

import torch
from torch import Tensor

from .metrics import mismatch_inputs

# The reference code skips batch normalisation below this mean weight (avoids dividing by ~0).
_BATCH_NORM_MIN_MEAN = 1e-8

PRESETS: dict[str, dict[str, Any]] = {
    "none": dict(
        is_weight=False, is_upper=None, token_mask_low=None, token_mask_high=None, seq_veto=None, batch_normalize=False
    ),
    "paper": dict(
        is_weight=True, is_upper=None, token_mask_low=None, token_mask_high=None, seq_veto=1e-4, batch_normalize=False
    ),
    "mis": dict(
        is_weight=True, is_upper=1.5, token_mask_low=0.5, token_mask_high=1.5, seq_veto=1e-4, batch_normalize=True
    ),
}


@dataclass(frozen=True)
class CorrectionConfig:
    """Knobs of the sparsity correction; command-line flags are `--correction-<field-with-dashes>` (each field's
    help says what it does). `preset`: the preset the knobs started from (`from_preset`); when built directly,
    the preset they equal, or "custom"."""

    is_weight: bool = field(default=False, metadata={"help": (
        "multiply each token's policy-gradient term by its (clamped, optionally truncated) xi = pi_old / pi_sparse")})
    is_upper: float | None = field(default=None, metadata={"help": (
        "truncate the weight at this value (TIS); unset: no truncation. Needs --correction-is-weight")})
    is_lower: float = field(default=0.0, metadata={"help": (
        "raise weights below this value to it (slime's --tis-clip-low); 0: no lower clip. Needs "
        "--correction-is-weight")})
    token_mask_low: float | None = field(default=None, metadata={"help": (
        "reject tokens whose xi lies below; unset: off")})
    token_mask_high: float | None = field(default=None, metadata={"help": (
        "reject tokens whose xi lies above; unset: off")})
    seq_veto: float | None = field(default=None, metadata={"help": (
        "reject a whole sequence if any token has xi below this (raw, unclamped ratio); unset: no veto")})
    batch_normalize: bool = field(default=False, metadata={"help": (
        "divide the weights by their mean over the batch's response tokens. Needs --correction-is-weight")})
    log_ratio_clamp: float = field(default=20.0, metadata={"help": (
        "|log xi| is clamped to this before exp, for the weight and the token mask (the reference's SAFETY_BOUND)")})
    preset: str = field(default="", metadata={
        "help": "none | paper | mis: the published setting to start from (other --correction-* flags override "
                "its knobs); unset: the knobs as given, which default to none's"})

    FLAG_PREFIX: ClassVar[str] = "--correction-"

    def __post_init__(self) -> None:
        if not self.preset:
            object.__setattr__(self, "preset", self.equal_preset())

    def equal_preset(self) -> str:
        """The preset whose knobs these are all equal to, or "custom"."""
        knobs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "preset"}
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name != "preset"}
        return next((name for name, values in PRESETS.items() if knobs == {**defaults, **values}), "custom")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "CorrectionConfig":
        """The `correction` section of a run config: its `preset` (if it names one) with the knobs it sets on top."""
        values = dict(values)
        preset = values.pop("preset", "")
        if preset in ("", "custom"):
            return cls(**values)
        return cls.from_preset(preset, **values)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "CorrectionConfig":
        """A preset ("none", "paper", "mis") with some knobs overridden; the result is validated."""
        if name not in PRESETS:
            raise ValueError(f"{cls.FLAG_PREFIX}preset={name!r} is invalid: choose one of {tuple(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)} - {"preset"}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            flags = ", ".join(cls._flag(k) for k in unknown)
            raise ValueError(f"unknown correction option(s) {flags}: known are {sorted(fields)}")
        cfg = cls(**{**PRESETS[name], **overrides, "preset": name})
        cfg.validate()
        return cfg

    @classmethod
    def _flag(cls, name: str) -> str:
        return cls.FLAG_PREFIX + name.replace("_", "-")

    def validate(self) -> None:
        """Raise ValueError naming the offending `--correction-*` flag."""

        def bad(name: str, value: Any, why: str) -> None:
            raise ValueError(f"{self._flag(name)}={value!r} is invalid: {why}")

        if self.preset not in (*PRESETS, "custom"):
            bad("preset", self.preset, f"choose one of {(*PRESETS, 'custom')}")
        for name in ("is_upper", "token_mask_high", "seq_veto"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                bad(name, value, "must be a finite number > 0 (or unset)")
        if not (math.isfinite(self.is_lower) and self.is_lower >= 0):
            bad("is_lower", self.is_lower, "must be a finite number >= 0 (0: no lower clip)")
        if self.is_upper is not None and self.is_lower >= self.is_upper:
            bad("is_lower", self.is_lower, f"must be < --correction-is-upper={self.is_upper!r}")
        if self.token_mask_low is not None and not (math.isfinite(self.token_mask_low) and self.token_mask_low >= 0):
            bad("token_mask_low", self.token_mask_low, "must be a finite number >= 0 (or unset)")
        if (
            self.token_mask_low is not None
            and self.token_mask_high is not None
            and self.token_mask_low >= self.token_mask_high
        ):
            bad("token_mask_low", self.token_mask_low, f"must be < --correction-token-mask-high={self.token_mask_high!r}")
        if not (math.isfinite(self.log_ratio_clamp) and self.log_ratio_clamp > 0):
            bad("log_ratio_clamp", self.log_ratio_clamp, "must be a finite number > 0")
        if self.is_upper is not None and not self.is_weight:
            bad("is_upper", self.is_upper, "truncation needs --correction-is-weight")
        if self.is_lower and not self.is_weight:
            bad("is_lower", self.is_lower, "clipping needs --correction-is-weight")
        if self.batch_normalize and not self.is_weight:
            bad("batch_normalize", self.batch_normalize, "weight normalisation needs --correction-is-weight")


@dataclass
class CorrectionResult:
    """Output of `sparsity_correction`.

    weights: [B, T] detached importance weights; 0 outside the original mask and on non-finite
        sequences. Not zeroed at rejected tokens (rejection lives in `mask`), as in the reference.
    mask: [B, T] float mask after token and sequence rejection; use it for the loss and its
        denominators.
    seq_kept: [B] bool, True where the sequence still has at least one token in `mask`.
    metrics: floats, see `sparsity_correction`.
    """

    weights: Tensor
    mask: Tensor
    seq_kept: Tensor
    metrics: dict[str, float]


def sparsity_correction(
    logp_old: Tensor,
    logp_sparse: Tensor,
    mask: Tensor,
    cfg: CorrectionConfig,
    *,
    batch_norm_reduce: Callable[[Tensor], Tensor] | None = None,
) -> CorrectionResult:
    """Importance weights and rejection mask for tokens sampled from pi_sparse.

    Args:
        logp_old: [B, T] dense log-probs of the sampled tokens (pi_old).
        logp_sparse: [B, T] sampler log-probs (pi_sparse), same temperature.
        mask: [B, T] response mask (bool or 0/1 float); padding is 0.
        cfg: the correction knobs.
        batch_norm_reduce: optional function applied to the tensor [sum of weights, token count]
            before the batch-normalisation mean is taken, e.g. a data-parallel all-reduce so the
            mean is global. Without it the mean is over this call's tokens, which is what the
            reference does (it normalises inside each micro-batch's loss call).

    Metrics ("correction/..."), token fractions over the original-mask tokens of finite sequences:
        seqs: sequences with >= 1 original mask token; seq_reject_rate: fraction of those without a
        kept token; token_reject_rate: 1 - kept tokens / original tokens; veto_seqs: sequences
        vetoed (finite ones); veto_token_frac: tokens with xi < seq_veto; nonfinite_seqs;
        xi_mean / xi_min / xi_max: of the clamped ratio; truncate_frac: xi > is_upper; clip_low_frac: xi < is_lower;
        mask_low_frac / mask_high_frac: xi below / above the token-mask bounds; batch_norm_factor:
        the mean the weights were divided by (1.0 when not applied); weight_mean: mean final weight
        over kept tokens.
    """
    cfg.validate()
    old, sparse, orig = mismatch_inputs(logp_old, logp_sparse, mask)
    dtype = old.dtype

    # A sequence with any non-finite value at a response position cannot be judged: reject it whole.
    raw_log_xi = old - sparse
    bad_token = orig & ~torch.isfinite(raw_log_xi)
    nonfinite_seq = bad_token.any(dim=-1)
    valid = orig & ~nonfinite_seq[:, None]
    raw_log_xi = torch.where(valid, raw_log_xi, torch.zeros((), dtype=dtype, device=old.device))

    # Clamped ratio: what the weight and the token mask see (exp cannot overflow).
    xi = torch.exp(raw_log_xi.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))

    zero = torch.zeros((), dtype=dtype, device=old.device)
    if cfg.is_weight:
        weights = xi.clamp(min=cfg.is_lower, max=cfg.is_upper)  # clamp(min=0, max=None) leaves xi as it is
    else:
        weights = torch.ones_like(xi)
    weights = torch.where(valid, weights, zero)

    keep = valid
    low_hit = valid & (xi < cfg.token_mask_low) if cfg.token_mask_low is not None else torch.zeros_like(valid)
    high_hit = valid & (xi > cfg.token_mask_high) if cfg.token_mask_high is not None else torch.zeros_like(valid)
    keep = keep & ~low_hit & ~high_hit

    if cfg.seq_veto is not None:
        # On the RAW log ratio: a ratio below exp(-20) must still trigger a veto at threshold < exp(-20).
        veto_token = valid & (raw_log_xi < math.log(cfg.seq_veto))
    else:
        veto_token = torch.zeros_like(valid)
    vetoed_seq = veto_token.any(dim=-1)
    keep = keep & ~vetoed_seq[:, None]

    norm_factor = torch.ones((), dtype=dtype, device=old.device)
    if cfg.batch_normalize:
        stats = torch.stack([weights.sum(), valid.sum().to(dtype)])
        if batch_norm_reduce is not None:
            stats = batch_norm_reduce(stats)
        mean_w = stats[0] / stats[1].clamp_min(1.0)
        apply = mean_w > _BATCH_NORM_MIN_MEAN
        norm_factor = torch.where(apply, mean_w, norm_factor)
        weights = weights / norm_factor

    out_mask = keep.to(dtype)
    seq_kept = keep.any(dim=-1)
    metrics = _correction_metrics(
        cfg, xi, orig, valid, keep, seq_kept, nonfinite_seq, veto_token, vetoed_seq, low_hit, high_hit,
        weights, norm_factor,
    )
    return CorrectionResult(weights=weights.detach(), mask=out_mask, seq_kept=seq_kept, metrics=metrics)


def _correction_metrics(
    cfg: CorrectionConfig,
    xi: Tensor,
    orig: Tensor,
    valid: Tensor,
    keep: Tensor,
    seq_kept: Tensor,
    nonfinite_seq: Tensor,
    veto_token: Tensor,
    vetoed_seq: Tensor,
    low_hit: Tensor,
    high_hit: Tensor,
    weights: Tensor,
    norm_factor: Tensor,
) -> dict[str, float]:
    f = xi.dtype
    has_tokens = orig.any(dim=-1)
    n_seqs = has_tokens.sum().to(f)
    n_orig = orig.sum().to(f)
    n_valid = valid.sum().to(f)
    n_keep = keep.sum().to(f)

    def frac(num: Tensor, den: Tensor) -> Tensor:
        return num.to(f) / den.clamp_min(1.0)

    any_valid = n_valid > 0
    one = torch.ones((), dtype=f, device=xi.device)
    xi_min = torch.where(valid, xi, torch.full_like(xi, torch.inf)).min() if xi.numel() else one
    xi_max = torch.where(valid, xi, torch.full_like(xi, -torch.inf)).max() if xi.numel() else one
    truncated = valid & (xi > cfg.is_upper) if (cfg.is_weight and cfg.is_upper is not None) else torch.zeros_like(valid)
    raised = valid & (xi < cfg.is_lower) if cfg.is_weight else torch.zeros_like(valid)

    values = {
        "correction/seqs": n_seqs,
        "correction/seq_reject_rate": frac((has_tokens & ~seq_kept).sum(), n_seqs),
        "correction/token_reject_rate": frac(n_orig - n_keep, n_orig),
        "correction/veto_seqs": (vetoed_seq & ~nonfinite_seq).sum().to(f),
        "correction/veto_token_frac": frac(veto_token.sum(), n_valid),
        "correction/nonfinite_seqs": (nonfinite_seq & has_tokens).sum().to(f),
        # Empty batch: report the neutral ratio 1 rather than NaN / inf.
        "correction/xi_mean": torch.where(any_valid, frac((xi * valid).sum(), n_valid), one),
        "correction/xi_min": torch.where(any_valid, xi_min, one),
        "correction/xi_max": torch.where(any_valid, xi_max, one),
        "correction/truncate_frac": frac(truncated.sum(), n_valid),
        "correction/clip_low_frac": frac(raised.sum(), n_valid),
        "correction/mask_low_frac": frac(low_hit.sum(), n_valid),
        "correction/mask_high_frac": frac(high_hit.sum(), n_valid),
        "correction/batch_norm_factor": norm_factor,
        "correction/weight_mean": frac((weights * keep).sum(), n_keep),
    }
    # One device->host transfer for all of them.
    floats = torch.stack([v.to(f).reshape(()) for v in values.values()]).tolist()
    return dict(zip(values.keys(), floats))
