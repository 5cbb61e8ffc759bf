"""The Sparse-RL policy loss: clipped PPO surrogate, sparsity weights outside the clip, KL, entropy.

Per token t of a kept sequence (r_t = pi_theta / pi_old, xi-weight w_t from `correction`):

    pg_t  = w_t * max(-r_t * A, -clip(r_t, 1 - eps_low, 1 + eps_high) * A)
            with dual clip (A < 0 only): pg_t = w_t * min(max(...), -eps_clip_c * A)
    kl_t  = KL estimator between pi_theta and pi_ref (k1 / k2 / k3 / low_var_kl)
    loss  = agg(pg) + kl_loss_coef * agg(kl) - entropy_coef * agg(entropy)

GSPO (`ratio_level="sequence"`): r_t is the sequence's s_i = exp(mean_t log(pi_theta / pi_old)) at every kept
token t of sequence i, so the clip acts on whole sequences; w_t is then a sequence-level weight too (the run
config refuses a token-level one: `advantages.check_composition`).

CISPO (`policy_loss_mode="cispo"`, MiniMax-M1 arXiv 2506.13585 eq. 4-5, slime's #2067 and verl's `cispo` loss mode):
the ratio is clipped as a stop-gradient weight instead of clipping the surrogate, so no token loses its gradient:

    pg_t  = - w_t * sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * log pi_theta(y_t)

(MiniMax-M1 sets no lower bound: --eps-clip 1.0, tuning --eps-clip-high; slime warns otherwise). Its value is not
PPO's (it is a REINFORCE term), its gradient is sg(clip(r)) * A * grad log pi. `pg_clipfrac` counts the tokens whose
ratio the clip changed, as slime and verl do.

`agg` is one of slime's / verl's aggregation modes over the (post-rejection) mask, so rejected tokens
leave the denominators too. Padded layout: every per-token tensor is [B, T] with a 0/1 mask [B, T].
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# sparse_rl: PPO on the dense policy, corrected by xi (Sparse-RL). shadow: PPO on pi_shadow, the policy under the
# sampler's own eviction mask, exactly on-policy (no correction). smd: shadow + smd_kl_coef * KL(dense || sg(shadow))
# (Shadow Mask Distillation, arXiv 2605.06850).
LOSS_TYPES = ("sparse_rl", "shadow", "smd")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
# token: r_t = pi_theta / pi_old per token (PPO, GRPO). sequence: GSPO's s_i = exp(mean_t log r_t), one ratio per
# sequence, set by --advantage-estimator gspo (slime's spelling; verl: policy_loss.loss_mode=gspo).
RATIO_LEVELS = ("token", "sequence")
# ppo_clip: PPO's clipped surrogate. cispo: CISPO's clipped stop-gradient weight on log pi (set by
# --advantage-estimator cispo, slime's spelling; verl: policy_loss.loss_mode=cispo).
POLICY_LOSS_MODES = ("ppo_clip", "cispo")

# log(pi_theta / pi_old) is clamped before exp, as verl does: a ratio of e^20 is already absurd and an
# inf ratio would turn the clipped branch's zero gradient into 0 * inf = NaN in backward.
_LOG_RATIO_CLAMP = 20.0

Number = float | int | Tensor


@dataclass(frozen=True)
class LossConfig:
    """Policy-loss knobs; flags are `--<field-with-dashes>` as in slime (each field's help says what it does)."""

    eps_clip: float = field(default=0.2, metadata={"help": "PPO clip range [1 - eps_clip, 1 + eps_clip_high]"})
    eps_clip_high: float | None = field(default=None, metadata={"help": "upper PPO clip; unset: --eps-clip"})
    eps_clip_c: float | None = field(default=None, metadata={"help": (
        "dual-clip constant (> 1) bounding the loss of negative-advantage tokens at -eps_clip_c x A; unset: off")})
    loss_agg_mode: str = field(default="seq-mean-token-mean", metadata={"help": (
        "seq-mean-token-mean (slime's) | token-mean | seq-mean-token-sum-norm (Dr.GRPO: / (sequences x "
        "--norm-len))")})
    use_kl_loss: bool = field(default=False, metadata={"help": "add a KL(pi_theta || pi_ref) penalty to the loss"})
    kl_loss_coef: float = field(default=0.0, metadata={"help": (
        "weight of the KL term under --use-kl-loss. At 0 (slime's GRPO scripts) no reference model is kept or run: "
        "the term would be multiplied by 0 (slime still computes it, for its log)")})
    kl_loss_type: str = field(default="low_var_kl", metadata={"help": (
        "k1 | k2 | k3 | low_var_kl (k3 clamped to [-10, 10]). slime's default is k1; low_var_kl here: non-negative "
        "and low-variance, the estimator GRPO uses and every slime GRPO script passes")})
    entropy_coef: float = field(default=0.0, metadata={"help": (
        "weight of the entropy bonus (subtracted from the loss)")})
    norm_len: int | None = field(default=None, metadata={"help": (
        "Dr.GRPO's constant length normaliser; unset: --rollout-max-response-len")})
    loss_type: str = field(default="sparse_rl", metadata={"help": (
        "sparse_rl: PPO on the dense policy with Sparse-RL's correction | shadow: PPO on pi_shadow, the policy "
        "recomputed under the sampler's own KV eviction mask (exactly on-policy, no correction) | smd: shadow + "
        "--smd-kl-coef * KL(pi_dense || stopgrad(pi_shadow)) (Shadow Mask Distillation). slime's --loss-type "
        "policy_loss is sparse_rl here")})
    smd_kl_coef: float = field(default=0.1, metadata={"help": (
        "lambda of --loss-type smd: weight of the full-vocabulary KL(pi_dense || stopgrad(pi_shadow)) per "
        "response token, aggregated like the policy loss (--loss-agg-mode)")})
    ratio_level: str = field(default="token", metadata={"help": (
        "token: PPO's ratio per token | sequence: GSPO's exp(mean_t log(pi_theta / pi_old)) per sequence. No flag "
        "of its own: --advantage-estimator gspo sets it")})
    policy_loss_mode: str = field(default="ppo_clip", metadata={"help": (
        "ppo_clip: PPO's clipped surrogate | cispo: CISPO's -sg(clip(r, 1 - eps_clip, 1 + eps_clip_high)) A log pi. "
        "No flag of its own: --advantage-estimator cispo sets it (slime's spelling)")})

    @property
    def trains_shadow(self) -> bool:
        """shadow / smd: the PPO term trains pi_shadow, the sampler's own policy: nothing is corrected or rejected,
        and every learner forward of it needs the samples' eviction records."""
        return self.loss_type != "sparse_rl"

    @property
    def distills(self) -> bool:
        """smd: a dense forward besides the shadow one, for KL(pi_dense || stopgrad(pi_shadow))."""
        return self.loss_type == "smd"

    @property
    def needs_ref(self) -> bool:
        """pi_ref is recomputed (and a reference model kept) only when the KL term weighs in the loss."""
        return self.use_kl_loss and self.kl_loss_coef > 0

    @property
    def eps_low(self) -> float:
        return self.eps_clip

    @property
    def eps_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    def validate(self) -> None:
        """Raise ValueError naming the offending flag."""

        def bad(name: str, value: Any, why: str) -> None:
            raise ValueError(f"--{name.replace('_', '-')}={value!r} is invalid: {why}")

        if self.policy_loss_mode == "cispo":  # CISPO's weight may go down to 0: MiniMax-M1's "no lower bound" is 1.0
            if not (math.isfinite(self.eps_clip) and 0 < self.eps_clip <= 1):
                bad("eps_clip", self.eps_clip, "must lie in (0, 1] under --advantage-estimator cispo (1: no lower "
                                               "bound on the weight, MiniMax-M1's)")
        elif not (math.isfinite(self.eps_clip) and 0 < self.eps_clip < 1):
            bad("eps_clip", self.eps_clip, "must lie in (0, 1) so that 1 - eps_clip > 0")
        if self.eps_clip_high is not None and not (math.isfinite(self.eps_clip_high) and self.eps_clip_high > 0):
            bad("eps_clip_high", self.eps_clip_high, "must be a finite number > 0 (or unset = --eps-clip)")
        if self.eps_clip_c is not None and not (math.isfinite(self.eps_clip_c) and self.eps_clip_c > 1):
            bad("eps_clip_c", self.eps_clip_c, "the dual-clip constant must be a finite number > 1 (or unset)")
        if self.loss_agg_mode not in AGG_MODES:
            bad("loss_agg_mode", self.loss_agg_mode, f"choose one of {AGG_MODES}")
        if self.kl_loss_type not in KL_TYPES:
            bad("kl_loss_type", self.kl_loss_type, f"choose one of {KL_TYPES}")
        if not (math.isfinite(self.kl_loss_coef) and self.kl_loss_coef >= 0):
            bad("kl_loss_coef", self.kl_loss_coef, "must be a finite number >= 0")
        if self.loss_type not in LOSS_TYPES:
            bad("loss_type", self.loss_type, f"choose one of {LOSS_TYPES} (slime's policy_loss is sparse_rl)")
        if not (math.isfinite(self.smd_kl_coef) and self.smd_kl_coef >= 0):
            bad("smd_kl_coef", self.smd_kl_coef, "must be a finite number >= 0")
        if self.ratio_level not in RATIO_LEVELS:
            bad("ratio_level", self.ratio_level, f"choose one of {RATIO_LEVELS}")
        if self.policy_loss_mode not in POLICY_LOSS_MODES:
            bad("policy_loss_mode", self.policy_loss_mode, f"choose one of {POLICY_LOSS_MODES}")
        if self.policy_loss_mode == "cispo" and self.eps_clip_c is not None:
            bad("eps_clip_c", self.eps_clip_c, "dual clip bounds PPO's clipped surrogate, which "
                                               "--advantage-estimator cispo does not use (CISPO's weight is already "
                                               "clipped; slime ignores it)")
        if self.policy_loss_mode == "cispo" and self.ratio_level != "token":
            bad("policy_loss_mode", self.policy_loss_mode, "CISPO clips a per-token ratio (GSPO's is per sequence)")
        if not math.isfinite(self.entropy_coef) or self.entropy_coef < 0:
            bad("entropy_coef", self.entropy_coef, "must be a finite number >= 0")
        if self.norm_len is not None and (
            isinstance(self.norm_len, bool) or not isinstance(self.norm_len, int) or self.norm_len < 1
        ):
            bad("norm_len", self.norm_len, "must be an integer >= 1 (or unset)")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.norm_len is None:
            bad("norm_len", self.norm_len, "--loss-agg-mode=seq-mean-token-sum-norm needs it (the max response length)")


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_seqs: Number | None = None,
    num_tokens: Number | None = None,
    norm_len: int | None = None,
) -> Tensor:
    """Reduce per-token `values` [B, T] under a 0/1 `mask` [B, T] to a scalar.

        token-mean              sum(v * m) / num_tokens
        seq-mean-token-mean     sum_i (sum_t v * m / sum_t m) / num_seqs
        seq-mean-token-sum-norm sum(v * m) / (num_seqs * norm_len)          (Dr.GRPO)

    num_seqs / num_tokens default to this call's counts (rows with >= 1 mask token, mask tokens).
    Under gradient accumulation or data parallelism pass the GLOBAL counts: the per-micro-batch
    results then sum to the aggregate of the whole batch. Rows with an all-zero mask contribute
    nothing and are not counted. Values at masked-out positions are ignored even if non-finite.
    An empty mask gives a zero that keeps the graph.
    """
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(f"values and mask must share one [B, T] shape, got {tuple(values.shape)} and {tuple(mask.shape)}")
    if mode not in AGG_MODES:
        raise ValueError(f"--loss-agg-mode={mode!r} is invalid: choose one of {AGG_MODES}")
    on = mask > 0
    m = on.to(values.dtype)
    # where() rather than a product: 0 * inf / 0 * NaN at padding would poison the sum and its gradient.
    v = torch.where(on, values, torch.zeros((), dtype=values.dtype, device=values.device))
    tokens_per_row = m.sum(dim=-1)

    if mode == "token-mean":
        denom = _as_tensor(num_tokens, m) if num_tokens is not None else tokens_per_row.sum()
        return v.sum() / denom.clamp_min(1.0)

    seqs = _as_tensor(num_seqs, m) if num_seqs is not None else (tokens_per_row > 0).sum().to(m.dtype)
    if mode == "seq-mean-token-mean":
        per_row = v.sum(dim=-1) / tokens_per_row.clamp_min(1.0)
        return per_row.sum() / seqs.clamp_min(1.0)
    if norm_len is None:
        raise ValueError("--loss-agg-mode=seq-mean-token-sum-norm needs norm_len (the max response length)")
    if norm_len < 1:
        raise ValueError(f"norm_len must be >= 1, got {norm_len}")
    return v.sum() / (seqs.clamp_min(1.0) * norm_len)


def _as_tensor(x: Number, like: Tensor) -> Tensor:
    return torch.as_tensor(x, dtype=like.dtype, device=like.device)


def kl_estimate(logp: Tensor, logp_ref: Tensor, kind: str) -> Tensor:
    """Per-token estimator of KL(pi_theta || pi_ref) from tokens sampled by (roughly) pi_theta.

    k1: logp - ref;  k2: (logp - ref)^2 / 2;  k3: exp(d) - d - 1 with d = ref - logp (slime's k3), d capped
    at 20 (as the PPO ratio's log): slime's exp(d) overflows to inf once pi_theta is e^88 below pi_ref on a
    sampled token, which the `none` correction preset lets through; below the cap the two are identical;
    low_var_kl: k3 with verl's guards, log ratio clamped to [-20, 20] and the result to [-10, 10].
    """
    if kind == "k1":
        return logp - logp_ref
    if kind == "k2":
        return 0.5 * (logp - logp_ref) ** 2
    if kind == "k3":
        d = (logp_ref - logp).clamp(max=_LOG_RATIO_CLAMP)
        return torch.exp(d) - d - 1
    if kind == "low_var_kl":
        d = (logp_ref - logp).clamp(-20.0, 20.0)
        return (torch.exp(d) - d - 1).clamp(-10.0, 10.0)
    raise ValueError(f"--kl-loss-type={kind!r} is invalid: choose one of {KL_TYPES}")


def categorical_kl(logp_p: Tensor, logp_q: Tensor) -> Tensor:
    """Exact KL(p || q) = sum_v p_v (log p_v - log q_v) per position, from log-softmax tensors [..., V].

    SMD's distillation term uses it with p = pi_dense (trained) and q = stopgrad(pi_shadow): both distributions
    are at hand at every response token (two forwards of the same batch), so no sampled estimator is needed,
    and a sampled one would be biased here (the tokens come from pi_shadow, not from pi_dense).
    Vocabulary entries where p = 0 contribute 0 (the limit), even where q = 0 too.
    """
    p = logp_p.exp()
    diff = torch.where(p > 0, logp_p - logp_q, torch.zeros((), dtype=logp_p.dtype, device=logp_p.device))
    return (p * diff).sum(dim=-1)


def policy_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    *,
    weights: Tensor | None = None,
    logp_ref: Tensor | None = None,
    entropy: Tensor | None = None,
    distill_kl: Tensor | None = None,
    num_seqs: Number | None = None,
    num_tokens: Number | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Sparse-RL / PPO-clip loss of one (micro-)batch.

    Args:
        logp: [B, T] log-probs of the sampled tokens under pi_theta (requires grad).
        logp_old: [B, T] pi_old log-probs (treated as constants).
        advantages: [B] per sequence or [B, T] per token.
        mask: [B, T] 0/1 mask after sparsity rejection.
        cfg: loss knobs.
        weights: [B, T] sparsity weights xi (detached), multiplied onto the clipped PPO term.
        logp_ref: [B, T] reference-policy log-probs; required when cfg.needs_ref.
        entropy: [B, T] per-token entropy of pi_theta; required when cfg.entropy_coef > 0.
        distill_kl: [B, T] KL(pi_dense || stopgrad(pi_shadow)) per token (`categorical_kl`, graph to the dense
            policy); required when cfg.loss_type == "smd", where `logp` / `logp_old` are the shadow policy's.
        num_seqs / num_tokens: global normalisers, see `aggregate`.

    Returns:
        (loss, metrics). Metrics are aggregated like the loss (same mask, mode and counts), so with
        global counts they too sum over micro-batches: "loss", "pg_loss", "pg_clipfrac" (tokens
        where the clip binds, i.e. gets zero gradient), "pg_dualclip_frac", "ppo_kl" (mean
        logp_old - logp), "kl_loss", "entropy_loss", "smd_kl" (the distillation KL, 0 unless smd),
        "loss/all_rejected" (1.0 if the mask is empty, in which case the loss is a graph-connected 0
        with zero gradient).

    `cfg` is validated once, when the run config is built: this runs per micro-batch and checks only its tensors.
    """
    if logp.dim() != 2 or not (logp.shape == logp_old.shape == mask.shape):
        raise ValueError(
            f"logp, logp_old and mask must share one [B, T] shape, got {tuple(logp.shape)}, "
            f"{tuple(logp_old.shape)}, {tuple(mask.shape)}"
        )
    for name, t in (("weights", weights), ("logp_ref", logp_ref), ("entropy", entropy), ("distill_kl", distill_kl)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} must have shape {tuple(logp.shape)}, got {tuple(t.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(logp.shape)}, got {tuple(advantages.shape)}")
    if cfg.needs_ref and logp_ref is None:
        raise ValueError("--use-kl-loss with --kl-loss-coef > 0 needs reference log-probs (logp_ref)")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError(f"--entropy-coef={cfg.entropy_coef} needs per-token entropy")
    if cfg.distills != (distill_kl is not None):
        raise ValueError(f"--loss-type={cfg.loss_type} {'needs' if cfg.distills else 'takes no'} distill_kl")

    on = mask > 0
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)

    def safe(x: Tensor) -> Tensor:
        # Padding may hold -inf / NaN; keep it out of every forward and backward computation.
        return torch.where(on, x.to(logp.dtype), zero)

    logp_s = safe(logp)
    if not bool(on.any()):
        names = ("loss", "pg_loss", "pg_clipfrac", "pg_dualclip_frac", "ppo_kl", "kl_loss", "entropy_loss", "smd_kl")
        return logp_s.sum() * 0.0, {**{k: 0.0 for k in names}, "loss/all_rejected": 1.0}

    agg_kwargs = dict(num_seqs=num_seqs, num_tokens=num_tokens, norm_len=cfg.norm_len)

    def agg(values: Tensor) -> Tensor:
        return aggregate(values, on, cfg.loss_agg_mode, **agg_kwargs)

    old = safe(logp_old.detach())
    adv = advantages.detach()
    adv = safe(adv[:, None].expand_as(logp) if adv.dim() == 1 else adv)

    log_ratio = logp_s - old
    if cfg.ratio_level == "sequence":
        # GSPO: s_i = exp(mean_t log r_t) over the sequence's kept tokens, the same value at each of its tokens;
        # each token's gradient is s_i * grad log pi_theta(y_t), verl's sg[log s_i] + logp - sg[logp] (slime
        # differentiates the mean itself: the same gradient under seq-mean-token-mean, the mode GSPO requires).
        seq = torch.where(on, log_ratio, zero).sum(-1) / on.sum(-1).clamp_min(1)
        log_ratio = seq.detach()[:, None] + logp_s - logp_s.detach()
    log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    if cfg.policy_loss_mode == "cispo":
        clipped = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high).detach()
        pg = -clipped * adv * logp_s  # the gradient flows through log pi only
        clip_active = clipped != ratio.detach()  # slime's / verl's CISPO clipfrac
    else:
        pg_unclipped = -adv * ratio
        pg_clipped = -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
        pg = torch.maximum(pg_unclipped, pg_clipped)
        clip_active = pg_clipped > pg_unclipped  # slime's clipfrac: the clipped branch is the one taken
    if cfg.eps_clip_c is not None:
        pg_dual = -cfg.eps_clip_c * adv
        dual_active = (adv < 0) & (pg > pg_dual)
        pg = torch.where(dual_active, pg_dual, pg)
    else:
        dual_active = torch.zeros_like(on)
    if weights is not None:
        pg = pg * safe(weights.detach())  # outside the clip: xi scales the token's whole PPO term

    pg_loss = agg(pg)
    loss = pg_loss
    kl_loss = zero
    if cfg.use_kl_loss and logp_ref is not None:  # given at coefficient 0 too: then only logged
        kl_loss = agg(kl_estimate(logp_s, safe(logp_ref.detach()), cfg.kl_loss_type))
        loss = loss + cfg.kl_loss_coef * kl_loss
    entropy_loss = zero
    if entropy is not None:
        entropy_loss = agg(safe(entropy))
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * entropy_loss
    smd_kl = zero
    if distill_kl is not None:
        smd_kl = agg(safe(distill_kl))
        loss = loss + cfg.smd_kl_coef * smd_kl

    with torch.no_grad():
        f = torch.promote_types(logp.dtype, torch.float32)  # metrics at least in fp32, even for bf16 log-probs
        values = {
            "loss": loss,
            "pg_loss": pg_loss,
            "pg_clipfrac": agg(clip_active.to(f)),
            "pg_dualclip_frac": agg(dual_active.to(f)),
            "ppo_kl": agg((old - logp_s).to(f)),
            "kl_loss": kl_loss,
            "entropy_loss": entropy_loss,
            "smd_kl": smd_kl,
        }
        floats = torch.stack([v.detach().to(f).reshape(()) for v in values.values()]).tolist()
    metrics = dict(zip(values.keys(), floats))
    metrics["loss/all_rejected"] = 0.0
    return loss, metrics
