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
           slime's `clip`), left as it is in `mask` mode [verl rollout_is_threshold, slime tis_mode].
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

Presets are named points of the algebra: ours (`PRESETS`: `none`, `paper`, `mis`) and verl's (`VERL_PRESETS`, its
RolloutCorrectionConfig factories at their defaults).

  none   weights 1, nothing rejected (plain GRPO on sparse rollouts).
  paper  the paper's rule: w = xi, reject a sequence if any xi_t < 1e-4.
  mis    the authors' released code (slime's mismatch helper, "truncate" mode, mis.yaml):
           w_t   = min(exp(clamp(log xi_t, -20, 20)), 1.5)
           token kept only if 0.5 <= exp(clamp(log xi_t, -20, 20)) <= 1.5
           sequence vetoed if any RAW log xi_t < log(1e-4)
           w <- w / mean(w), the mean over every token of the ORIGINAL response mask (before any
           rejection), skipped when that mean <= 1e-8.

Conventions (same as the references): weights are defined on every original-mask token, rejection is
expressed only through the returned mask, and the loss uses both (multiply by the weight, aggregate
with the mask, which also shrinks the denominators). Metrics are taken over the original mask.
Deviation from the references, on purpose: a sequence with a non-finite log-prob (-inf, +inf or NaN, from
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

# The references skip batch normalisation below this mean weight (avoids dividing by ~0).
_BATCH_NORM_MIN_MEAN = 1e-8

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")
# verl's rejection statistics: "<where>_<estimator>"; where = token | seq_sum | seq_mean | seq_max
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")

_NONE: dict[str, Any] = dict(is_weight=False, is_upper=None, token_mask_low=None, token_mask_high=None, seq_veto=None,
                             batch_normalize=False)
# Ours: the published Sparse-RL settings.
PRESETS: dict[str, dict[str, Any]] = {
    "none": _NONE,
    "paper": {**_NONE, "is_weight": True, "seq_veto": 1e-4},
    "mis": dict(
        is_weight=True, is_upper=1.5, token_mask_low=0.5, token_mask_high=1.5, seq_veto=1e-4, batch_normalize=True
    ),
}
# verl's RolloutCorrectionConfig factories (verl HEAD 2026-01), at their default arguments. The reinforce ones
# (bypass_pg_*) need verl's REINFORCE loss, which is not ours; verl's `disabled` is `none`.
VERL_PRESETS: dict[str, dict[str, Any]] = {
    "decoupled_token_is": {**_NONE, "is_weight": True, "is_upper": 2.0},
    "decoupled_seq_is": {**_NONE, "is_weight": True, "is_level": "sequence", "is_upper": 2.0},
    "decoupled_seq_is_rs": {**_NONE, "is_weight": True, "is_level": "sequence", "is_upper": 2.0,
                            "rs": ("seq_sum_k1",), "rs_threshold": ("0.5_2.0",)},
    "decoupled_geo_rs": {**_NONE, "rs": ("seq_mean_k1",), "rs_threshold": ("0.999_1.001",)},
    "decoupled_geo_rs_token_tis": {**_NONE, "is_weight": True, "is_upper": 2.0,
                                   "rs": ("seq_mean_k1",), "rs_threshold": ("0.999_1.001",)},
    "decoupled_geo_rs_seq_tis": {**_NONE, "is_weight": True, "is_level": "sequence", "is_upper": 2.0,
                                 "rs": ("seq_mean_k1",), "rs_threshold": ("0.999_1.001",)},
    "decoupled_k3_rs": {**_NONE, "rs": ("seq_mean_k3",), "rs_threshold": ("0.01",)},
    "decoupled_k3_rs_token_tis": {**_NONE, "is_weight": True, "is_upper": 2.0,
                                  "rs": ("seq_mean_k3",), "rs_threshold": ("0.01",)},
    "decoupled_k3_rs_seq_tis": {**_NONE, "is_weight": True, "is_level": "sequence", "is_upper": 2.0,
                                "rs": ("seq_mean_k3",), "rs_threshold": ("0.01",)},
    "bypass_ppo_clip": {**_NONE, "bypass_mode": True},
    "bypass_ppo_clip_geo_rs": {**_NONE, "bypass_mode": True, "rs": ("seq_mean_k1",), "rs_threshold": ("0.999_1.001",)},
    "bypass_ppo_clip_k3_rs": {**_NONE, "bypass_mode": True, "rs": ("seq_mean_k3",), "rs_threshold": ("0.01",)},
}
ALL_PRESETS: dict[str, dict[str, Any]] = {**PRESETS, **VERL_PRESETS}


@dataclass(frozen=True)
class RejectionRule:
    """One `rs` option, parsed: keep where lower <= statistic <= upper (log-space bounds for k1, else the
    estimator's own scale; None: unbounded on that side)."""

    option: str
    where: str  # token | seq_sum | seq_mean | seq_max
    estimator: str  # k1 | k2 | k3
    lower: float | None
    upper: float


def parse_rejection_rules(options: tuple[str, ...], thresholds: tuple[str, ...], flag: Callable[[str], str]
                          ) -> tuple[RejectionRule, ...]:
    """`rs` and `rs_threshold` (verl's rollout_rs / rollout_rs_threshold) as rules; ValueError naming the flag.

    One threshold per option, or one for all. k1 options take "lower_upper" ratio bounds or one upper bound U
    (lower 1/U); k2 / k3 options one upper bound."""
    if not options:
        if thresholds:
            raise ValueError(f"{flag('rs_threshold')}={','.join(thresholds)} has no effect without {flag('rs')}")
        return ()
    for opt in options:
        if opt not in RS_OPTIONS:
            raise ValueError(f"{flag('rs')}={opt!r} is invalid: choose from {', '.join(RS_OPTIONS)}")
    if len(set(options)) < len(options):
        raise ValueError(f"{flag('rs')}={','.join(options)} names an option twice")
    if len(thresholds) not in (1, len(options)):
        raise ValueError(f"{flag('rs_threshold')} takes one threshold for all {flag('rs')} options or one per option "
                         f"({len(options)}), got {len(thresholds)}")
    spec = thresholds * len(options) if len(thresholds) == 1 else thresholds
    rules = []
    for opt, text in zip(options, spec):
        where, estimator = opt.rsplit("_", 1)
        bad = f"{flag('rs_threshold')}={text!r} is invalid for {opt}"
        try:
            parts = [float(x) for x in str(text).split("_")]
        except ValueError:
            raise ValueError(f"{bad}: not a number{' or lower_upper' if estimator == 'k1' else ''}") from None
        if not all(math.isfinite(x) and x > 0 for x in parts) or len(parts) > (2 if estimator == "k1" else 1):
            raise ValueError(f"{bad}: " + ("positive ratio bounds 'lower_upper' or one upper bound" if estimator == "k1"
                                           else "one positive upper bound"))
        if estimator == "k1":
            low, high = parts if len(parts) == 2 else (1.0 / parts[0], parts[0])
            if low >= high:
                raise ValueError(f"{bad}: the lower bound must be below the upper one")
            rules.append(RejectionRule(opt, where, estimator, math.log(low), math.log(high)))
        else:
            rules.append(RejectionRule(opt, where, estimator, None, parts[0]))
    return tuple(rules)


@dataclass(frozen=True)
class CorrectionConfig:
    """Knobs of the sparsity correction; command-line flags are `--correction-<field-with-dashes>` (each field's
    help says what it does and names the peer's spelling). `preset`: the preset the knobs started from
    (`from_preset`); when built directly, the preset they equal, or "custom"."""

    is_weight: bool = field(default=False, metadata={"help": (
        "multiply each token's policy-gradient term by its importance weight (the --correction-is-level ratio "
        "pi_old / pi_sparse, bounded by --correction-is-mode); verl: rollout_is set, slime: --use-tis")})
    is_upper: float | None = field(default=None, metadata={"help": (
        "upper bound of the weight: truncate mode caps the weight at it (TIS), mask mode rejects above it; unset: "
        "none. verl's rollout_is_threshold, slime's --tis-clip / tis_upper_bound. Needs --correction-is-weight")})
    is_lower: float = field(default=0.0, metadata={"help": (
        "lower bound of the weight: truncate mode raises weights below it to it (slime's --tis-clip-low, the "
        "`clip` mode of its MIS helper), mask mode rejects below it (slime defaults an unset one to 1/upper; here "
        "0 means none). Needs --correction-is-weight")})
    is_level: str = field(default="token", metadata={"help": (
        "token | sequence | geometric: the ratio the weight (and mask mode) reads: per token xi_t, per sequence "
        "prod xi_t, or its geometric mean (verl's rollout_is, slime's tis_level). Needs --correction-is-weight")})
    is_mode: str = field(default="truncate", metadata={"help": (
        "truncate: the weight is bounded to [is-lower, is-upper] | mask: the weight is the ratio as it is and "
        "what lies outside the bounds is rejected, whole sequences at the sequence / geometric level (slime's "
        "tis_mode; its `clip` is truncate with --correction-is-lower). mask needs --correction-is-upper")})
    token_mask_low: float | None = field(default=None, metadata={"help": (
        "reject tokens whose xi lies below; unset: off (slime's rs_lower_bound at rs_level token)")})
    token_mask_high: float | None = field(default=None, metadata={"help": (
        "reject tokens whose xi lies above; unset: off (slime's rs_upper_bound at rs_level token)")})
    rs: tuple[str, ...] = field(default=(), metadata={"help": (
        "rejection statistics, verl's rollout_rs options (every one must pass): token_k1..3, seq_sum_k1..3, "
        "seq_mean_k1..3, seq_max_k2..3; k1 = -log xi, k2 = (log xi)^2 / 2, k3 = xi - 1 - log xi per token, "
        "then the token's own value, or the sum / mean / max over its sequence (seq_mean_k1: geometric)")})
    rs_threshold: tuple[str, ...] = field(default=(), metadata={"help": (
        "verl's rollout_rs_threshold, one for all --correction-rs options or one each: k1 options 'lower_upper' "
        "bounds on exp(k1) = pi_sparse / pi_old (verl's orientation: 1/xi) or one upper U (lower 1/U); k2 / k3 "
        "options one upper bound")})
    seq_veto: float | None = field(default=None, metadata={"help": (
        "reject a whole sequence if any token has xi below this (raw, unclamped ratio); unset: no veto (verl's "
        "rollout_token_veto_threshold, slime's rs_veto_threshold, the paper's eps_reject)")})
    opsm_delta: float | None = field(default=None, metadata={"help": (
        "OPSM, off-policy sequence masking: reject a sequence with a negative advantage whose mean "
        "log(pi_sparse / pi_old) exceeds this; unset: off. slime's --use-opsm --opsm-delta, computed here once "
        "per rollout between the sampler and the dense recompute (slime: per step, against pi_theta)")})
    batch_normalize: bool = field(default=False, metadata={"help": (
        "divide the weights by their mean over the batch's response tokens (sequences at the sequence / geometric "
        "level); verl's rollout_is_batch_normalize, slime's tis_batch_normalize. Needs --correction-is-weight")})
    bypass_mode: bool = field(default=False, metadata={"help": (
        "the PPO anchor pi_old is the sampler's log-prob (verl's bypass_mode, slime's --use-rollout-logprobs): "
        "PPO's ratio pi_theta / pi_sparse corrects the mismatch, so no weight may be set. It skips the dense "
        "recompute of pi_old unless a rejection rule reads xi or mismatch metrics are due "
        "(--mismatch-metrics-interval)")})
    log_ratio_clamp: float = field(default=20.0, metadata={"help": (
        "|log ratio| is clamped to this before exp, for weights, masks and rejection statistics (the references' "
        "SAFETY_BOUND)")})
    preset: str = field(default="", metadata={
        "help": "a published setting to start from (other --correction-* flags override its knobs): none | paper | "
                "mis (ours) | decoupled_token_is | decoupled_seq_is | decoupled_seq_is_rs | decoupled_geo_rs | "
                "decoupled_geo_rs_token_tis | decoupled_geo_rs_seq_tis | decoupled_k3_rs | decoupled_k3_rs_token_tis "
                "| decoupled_k3_rs_seq_tis | bypass_ppo_clip | bypass_ppo_clip_geo_rs | bypass_ppo_clip_k3_rs "
                "(verl's); unset: the knobs as given, which default to none's"})

    FLAG_PREFIX: ClassVar[str] = "--correction-"

    def __post_init__(self) -> None:
        if not self.preset:
            object.__setattr__(self, "preset", self.equal_preset())

    def equal_preset(self) -> str:
        """The preset whose knobs these are all equal to, or "custom"."""
        knobs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "preset"}
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name != "preset"}
        return next((name for name, values in ALL_PRESETS.items() if knobs == {**defaults, **values}), "custom")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "CorrectionConfig":
        """The `correction` section of a run config: its `preset` (if it names one) with the knobs it sets on top.
        A section saved before a knob existed lacks it: the knob keeps its default, which is the old behaviour."""
        values = dict(values)
        for name in ("rs", "rs_threshold"):  # one option (a string), or a number for a threshold
            if isinstance(values.get(name), (str, int, float)):
                values[name] = (values[name],)
            if name in values:
                values[name] = tuple(str(v) for v in values[name])
        preset = values.pop("preset", "")
        if preset in ("", "custom"):
            return cls(**values)
        return cls.from_preset(preset, **values)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "CorrectionConfig":
        """A preset (`ALL_PRESETS`) with some knobs overridden; the result is validated."""
        if name not in ALL_PRESETS:
            raise ValueError(f"{cls.FLAG_PREFIX}preset={name!r} is invalid: choose one of {tuple(ALL_PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)} - {"preset"}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            flags = ", ".join(cls._flag(k) for k in unknown)
            raise ValueError(f"unknown correction option(s) {flags}: known are {sorted(fields)}")
        cfg = cls(**{**ALL_PRESETS[name], **overrides, "preset": name})
        cfg.validate()
        return cfg

    @classmethod
    def _flag(cls, name: str) -> str:
        return cls.FLAG_PREFIX + name.replace("_", "-")

    @property
    def rules(self) -> tuple[RejectionRule, ...]:
        """The `rs` options as parsed rules (validated)."""
        return parse_rejection_rules(self.rs, self.rs_threshold, self._flag)

    @property
    def rejects(self) -> bool:
        """Some rule may reject a token or sequence that has finite log-probs (every rule reads pi_old)."""
        return bool(self.token_mask_low is not None or self.token_mask_high is not None or self.seq_veto is not None
                    or self.rs or self.opsm_delta is not None or (self.is_weight and self.is_mode == "mask"))

    @property
    def needs_dense(self) -> bool:
        """The dense recompute of pi_old is needed for training: as the PPO anchor (unless bypass) or for a rule."""
        return not self.bypass_mode or self.rejects

    def diagnostic_bounds(self) -> dict[str, Any]:
        """The token-mask bounds and veto threshold the mismatch diagnostics count against (what this run's rules
        reject, or would): the run's own where it sets them, else `mis`'s (0.5, 1.5) and 1e-4, so that every run
        (dense and naive ones too) logs the same comparable shares."""
        mis = PRESETS["mis"]
        own = self.token_mask_low is not None or self.token_mask_high is not None
        bounds = (self.token_mask_low, self.token_mask_high) if own else (mis["token_mask_low"], mis["token_mask_high"])
        return {"token_bounds": bounds, "veto": self.seq_veto if self.seq_veto is not None else mis["seq_veto"]}

    def validate(self) -> None:
        """Raise ValueError naming the offending `--correction-*` flag."""

        def bad(name: str, value: Any, why: str) -> None:
            raise ValueError(f"{self._flag(name)}={value!r} is invalid: {why}")

        if self.preset not in (*ALL_PRESETS, "custom"):
            bad("preset", self.preset, f"choose one of {(*ALL_PRESETS, 'custom')}")
        if self.is_level not in LEVELS:
            bad("is_level", self.is_level, f"choose one of {LEVELS}")
        if self.is_mode not in MODES:
            bad("is_mode", self.is_mode, f"choose one of {MODES}")
        for name in ("is_upper", "token_mask_high", "seq_veto"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                bad(name, value, "must be a finite number > 0 (or unset)")
        if not (math.isfinite(self.is_lower) and self.is_lower >= 0):
            bad("is_lower", self.is_lower, "must be a finite number >= 0 (0: no lower bound)")
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
        if self.opsm_delta is not None and not (math.isfinite(self.opsm_delta) and self.opsm_delta >= 0):
            bad("opsm_delta", self.opsm_delta, "must be a finite number >= 0 (or unset)")
        if not (math.isfinite(self.log_ratio_clamp) and self.log_ratio_clamp > 0):
            bad("log_ratio_clamp", self.log_ratio_clamp, "must be a finite number > 0")
        if self.is_upper is not None and not self.is_weight:
            bad("is_upper", self.is_upper, "truncation needs --correction-is-weight")
        if self.is_lower and not self.is_weight:
            bad("is_lower", self.is_lower, "clipping needs --correction-is-weight")
        if self.batch_normalize and not self.is_weight:
            bad("batch_normalize", self.batch_normalize, "weight normalisation needs --correction-is-weight")
        if self.is_level != "token" and not self.is_weight:
            bad("is_level", self.is_level, "a weight level needs --correction-is-weight (rejection at the sequence "
                                           "level: --correction-rs seq_sum_k1 / seq_mean_k1)")
        if self.is_mode == "mask" and not (self.is_weight and self.is_upper is not None):
            bad("is_mode", self.is_mode, "mask mode needs --correction-is-weight and --correction-is-upper")
        if self.bypass_mode and self.is_weight:
            bad("bypass_mode", self.bypass_mode, "the PPO ratio pi_theta / pi_sparse already reweights the "
                                                 "sampler's tokens; --correction-is-weight would apply it twice")
        self.rules  # noqa: B018  (parses rs / rs_threshold, naming the flag on error)


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
        ratio above is_upper / below is_lower (truncated, or rejected in mask mode); mask_low_frac /
        mask_high_frac: xi below / above the token-mask bounds; rs_<option>_token_frac / _seq_frac: tokens /
        sequences an `rs` option rejects (verl's rollout_rs_<option>_masked_fraction / _seq_masked_fraction);
        opsm_seq_frac: sequences OPSM rejects; is_mean / is_std / is_ess: mean, standard deviation and effective
        sample size 1 / mean((w / mean w)^2) of the weights before batch normalisation, token-weighted (verl's
        rollout_is_mean / _std / _eff_sample_size); batch_norm_factor: the mean the weights were divided by (1.0
        when not applied); weight_mean: mean final weight over kept tokens.
    """
    rules = cfg.rules  # validates rs / rs_threshold
    cfg.validate()
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
        weights = level_ratio.clamp(min=cfg.is_lower, max=cfg.is_upper) if cfg.is_mode == "truncate" else level_ratio
        above = valid & (level_ratio > cfg.is_upper) if cfg.is_upper is not None else none
        below = valid & (level_ratio < cfg.is_lower)
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
            raise ValueError(f"{cfg._flag('opsm_delta')} needs the [B] per-sequence advantages, got "
                             f"{None if advantages is None else tuple(advantages.shape)}")
        seq_kl = -raw_log_xi.sum(dim=-1) / valid.sum(dim=-1).clamp_min(1)  # mean log(pi_sparse / pi_old)
        opsm_seq = valid.any(dim=-1) & (advantages.to(old.device) < 0) & (seq_kl > cfg.opsm_delta)
        keep = keep & ~opsm_seq[:, None]

    weights_before_norm = weights
    norm_factor = torch.ones((), dtype=dtype, device=old.device)
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
    seq_kept = keep.any(dim=-1)
    metrics = _correction_metrics(
        _Counts(orig=orig, valid=valid, keep=keep, seq_kept=seq_kept, nonfinite_seq=nonfinite_seq,
                veto_token=veto_token, vetoed_seq=vetoed_seq, opsm_seq=opsm_seq, low_hit=low_hit, high_hit=high_hit,
                above=above, below=below, rule_rejects=rule_rejects),
        xi, weights_before_norm, weights, norm_factor,
    )
    return CorrectionResult(weights=weights.detach(), mask=out_mask, seq_kept=seq_kept, metrics=metrics)


@dataclass
class _Counts:
    """The boolean masks the metrics count ([B, T] tokens, [B] sequences)."""

    orig: Tensor
    valid: Tensor
    keep: Tensor
    seq_kept: Tensor
    nonfinite_seq: Tensor
    veto_token: Tensor
    vetoed_seq: Tensor
    opsm_seq: Tensor
    low_hit: Tensor
    high_hit: Tensor
    above: Tensor
    below: Tensor
    rule_rejects: dict[str, Tensor]


def _correction_metrics(c: _Counts, xi: Tensor, raw_weights: Tensor, weights: Tensor,
                        norm_factor: Tensor) -> dict[str, float]:
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
