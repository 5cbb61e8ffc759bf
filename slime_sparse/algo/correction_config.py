"""The knobs of the sparsity correction (`CorrectionConfig`, flags `--correction-*`), their validation, and its
presets. The algebra the knobs are terms of, and the correction itself: correction.py.

Presets are named points of the algebra, started from by one mechanism with the KV presets (utils/presets.py
`FromPreset`): ours (`PRESETS`: `none`, `paper`, `mis`) and verl's (`VERL_PRESETS`, its RolloutCorrectionConfig
factories at their defaults).

  none   weights 1, nothing rejected (plain GRPO on sparse rollouts).
  paper  the paper's rule: w = xi, reject a sequence if any xi_t < 1e-4.
  mis    the authors' released code (slime's mismatch helper, "truncate" mode, mis.yaml):
           w_t   = min(exp(clamp(log xi_t, -20, 20)), 1.5)
           token kept only if 0.5 <= exp(clamp(log xi_t, -20, 20)) <= 1.5
           sequence vetoed if any RAW log xi_t < log(1e-4)
           w <- w / mean(w), the mean over every token of the ORIGINAL response mask (before any
           rejection), skipped when that mean <= 1e-8.
  icepop IcePop (Ring-1T, arXiv 2510.18855) at verl's defaults (`decoupled_token_icepop`, verl #5722; slime's
         `icepop_function`): w_t = xi_t where 0.5 <= xi_t <= 5.0, else 0, the token staying in the loss's
         denominators (a zero weight, not a rejection).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, ClassVar, Mapping

from slime_sparse.utils.presets import FromPreset, Preset

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask", "icepop")
# verl's rejection statistics: "<where>_<estimator>"; where = token | seq_sum | seq_mean | seq_max
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def _verl(name: str, **values: Any) -> Preset:
    return Preset(f"verl's RolloutCorrectionConfig.{name}() at its default arguments (verl HEAD 2026-01)", values)


# Ours: the published Sparse-RL settings.
PRESETS: dict[str, Preset] = {
    "none": Preset("no correction: weights 1, nothing rejected (plain GRPO on sparse rollouts)"),
    "paper": Preset("Sparse-RL (arXiv 2601.10079): w = xi, a sequence rejected if any xi_t < 1e-4",
                    dict(is_weight=True, seq_veto=1e-4)),
    "mis": Preset("the authors' released code: slime's mismatch helper in truncate mode (mis.yaml)",
                  dict(is_weight=True, is_upper=1.5, token_mask_low=0.5, token_mask_high=1.5, seq_veto=1e-4,
                       batch_normalize=True)),
    "icepop": Preset("IcePop (Ring-1T, arXiv 2510.18855) at verl's defaults (= decoupled_token_icepop): w = xi "
                     "inside [0.5, 5], 0 outside; slime: --custom-tis-function-path ...loss.icepop_function",
                     dict(is_weight=True, is_mode="icepop", is_lower=0.5, is_upper=5.0)),
}
# verl's RolloutCorrectionConfig factories. The reinforce ones (bypass_pg_*) need verl's REINFORCE loss, which is
# not ours; verl's `disabled` is `none`.
VERL_PRESETS: dict[str, Preset] = {name: _verl(name, **values) for name, values in {
    "decoupled_token_is": dict(is_weight=True, is_upper=2.0),
    "decoupled_seq_is": dict(is_weight=True, is_level="sequence", is_upper=2.0),
    "decoupled_token_icepop": dict(is_weight=True, is_mode="icepop", is_lower=0.5, is_upper=5.0),
    "decoupled_seq_is_rs": dict(is_weight=True, is_level="sequence", is_upper=2.0, rs=("seq_sum_k1",),
                                rs_threshold=("0.5_2.0",)),
    "decoupled_geo_rs": dict(rs=("seq_mean_k1",), rs_threshold=("0.999_1.001",)),
    "decoupled_geo_rs_token_tis": dict(is_weight=True, is_upper=2.0, rs=("seq_mean_k1",),
                                       rs_threshold=("0.999_1.001",)),
    "decoupled_geo_rs_seq_tis": dict(is_weight=True, is_level="sequence", is_upper=2.0, rs=("seq_mean_k1",),
                                     rs_threshold=("0.999_1.001",)),
    "decoupled_k3_rs": dict(rs=("seq_mean_k3",), rs_threshold=("0.01",)),
    "decoupled_k3_rs_token_tis": dict(is_weight=True, is_upper=2.0, rs=("seq_mean_k3",), rs_threshold=("0.01",)),
    "decoupled_k3_rs_seq_tis": dict(is_weight=True, is_level="sequence", is_upper=2.0, rs=("seq_mean_k3",),
                                    rs_threshold=("0.01",)),
    "bypass_ppo_clip": dict(bypass_mode=True),
    "bypass_ppo_clip_geo_rs": dict(bypass_mode=True, rs=("seq_mean_k1",), rs_threshold=("0.999_1.001",)),
    "bypass_ppo_clip_k3_rs": dict(bypass_mode=True, rs=("seq_mean_k3",), rs_threshold=("0.01",)),
}.items()}
ALL_PRESETS: dict[str, Preset] = {**PRESETS, **VERL_PRESETS}


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
class CorrectionConfig(FromPreset):
    """Knobs of the sparsity correction; command-line flags are `--correction-<field-with-dashes>` (each field's
    help says what it does and names the peer's spelling), validated when built. `preset`: the preset the knobs
    started from (`from_preset`); when built directly, the preset they equal, or "custom"."""

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
        "tis_mode; its `clip` is truncate with --correction-is-lower) | icepop: the weight is the ratio inside the "
        "bounds and 0 outside, the token staying in the loss's denominators (IcePop; verl's 'lower_upper' "
        "rollout_is_threshold, slime's icepop_function). mask and icepop need --correction-is-upper")})
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
                "mis | icepop (ours) | decoupled_token_is | decoupled_seq_is | decoupled_token_icepop | "
                "decoupled_seq_is_rs | decoupled_geo_rs | "
                "decoupled_geo_rs_token_tis | decoupled_geo_rs_seq_tis | decoupled_k3_rs | decoupled_k3_rs_token_tis "
                "| decoupled_k3_rs_seq_tis | bypass_ppo_clip | bypass_ppo_clip_geo_rs | bypass_ppo_clip_k3_rs "
                "(verl's); unset: the knobs as given, which default to none's"})

    FLAG_PREFIX: ClassVar[str] = "--correction-"
    PRESETS: ClassVar[Mapping[str, Preset]] = ALL_PRESETS

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "CorrectionConfig":
        values = dict(values)
        for name in ("rs", "rs_threshold"):  # one option (a string), or a number for a threshold
            if isinstance(values.get(name), (str, int, float)):
                values[name] = (values[name],)
            if name in values:
                values[name] = tuple(str(v) for v in values[name])
        return super().from_dict(values)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.validate()  # once, when built: the correction runs every rollout and checks nothing

    @cached_property
    def rules(self) -> tuple[RejectionRule, ...]:
        """The `rs` options as parsed rules (validated)."""
        return parse_rejection_rules(self.rs, self.rs_threshold, self.flag)

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
        mis = PRESETS["mis"].values
        own = self.token_mask_low is not None or self.token_mask_high is not None
        bounds = (self.token_mask_low, self.token_mask_high) if own else (mis["token_mask_low"], mis["token_mask_high"])
        return {"token_bounds": bounds, "veto": self.seq_veto if self.seq_veto is not None else mis["seq_veto"]}

    def validate(self) -> None:
        """Raise ValueError naming the offending `--correction-*` flag."""

        def bad(name: str, value: Any, why: str) -> None:
            raise ValueError(f"{self.flag(name)}={value!r} is invalid: {why}")

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
        if self.is_mode != "truncate" and not (self.is_weight and self.is_upper is not None):
            bad("is_mode", self.is_mode, f"{self.is_mode} mode needs --correction-is-weight and --correction-is-upper")
        if self.bypass_mode and self.is_weight:
            bad("bypass_mode", self.bypass_mode, "the PPO ratio pi_theta / pi_sparse already reweights the "
                                                 "sampler's tokens; --correction-is-weight would apply it twice")
        self.rules  # noqa: B018  (parses rs / rs_threshold, naming the flag on error)
