"""Policy loss: hand values, exact gradients, aggregation modes, micro-batching, an independent loop."""
import math
import random

import pytest
import torch

from slime_sparse.algo import AGG_MODES, LossConfig, aggregate, kl_estimate, policy_loss

NAN, INF = float("nan"), float("inf")


def one_token(ratio, adv, cfg, weight=None):
    """Loss and d loss / d logp for a single token with logp_old = 0 and logp = log(ratio)."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    w = None if weight is None else torch.tensor([[weight]], dtype=torch.float64)
    loss, metrics = policy_loss(logp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64),
                                torch.ones(1, 1), cfg, weights=w)
    loss.backward()
    return loss.item(), logp.grad.item(), metrics


# ------------------------------------------------------------------ single-token hand values
@pytest.mark.parametrize(
    "ratio, adv, loss, grad, clipped",
    [
        (1.1, 1.0, -1.1, -1.1, 0.0),  # inside the clip: d(-r*A)/dlogp = -r*A
        (1.5, 1.0, -1.2, 0.0, 1.0),  # A > 0, r > 1 + eps: clipped, no gradient
        (0.5, 1.0, -0.5, -0.5, 0.0),  # A > 0, r < 1 - eps: the min keeps the unclipped term
        (0.5, -1.0, 0.8, 0.0, 1.0),  # A < 0, r < 1 - eps: clipped
        (1.5, -1.0, 1.5, 1.5, 0.0),  # A < 0, r > 1 + eps: unclipped (pessimistic) term
    ],
)
def test_ppo_clip_single_token(ratio, adv, loss, grad, clipped):
    got_loss, got_grad, metrics = one_token(ratio, adv, LossConfig(eps_clip=0.2))
    assert got_loss == pytest.approx(loss, rel=1e-12)
    assert got_grad == pytest.approx(grad, rel=1e-12, abs=0)
    assert metrics["pg_clipfrac"] == clipped


def test_asymmetric_clip_high():
    cfg = LossConfig(eps_clip=0.2, eps_clip_high=0.28)
    loss, grad, _ = one_token(1.25, 1.0, cfg)  # inside [0.8, 1.28]
    assert (loss, grad) == (pytest.approx(-1.25), pytest.approx(-1.25))
    loss, grad, _ = one_token(1.4, 1.0, cfg)
    assert (loss, grad) == (pytest.approx(-1.28), 0.0)


def test_dual_clip():
    cfg = LossConfig(eps_clip=0.2, eps_clip_c=3.0)
    loss, grad, metrics = one_token(5.0, -1.0, cfg)  # min(max(5, 1.2), 3) = 3: bounded, no gradient
    assert loss == pytest.approx(3.0) and grad == 0.0 and metrics["pg_dualclip_frac"] == 1.0
    loss, grad, metrics = one_token(2.0, -1.0, cfg)  # below the bound: plain pessimistic term
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0) and metrics["pg_dualclip_frac"] == 0.0
    loss, grad, metrics = one_token(5.0, 1.0, cfg)  # A > 0 never dual-clipped
    assert loss == pytest.approx(-1.2) and metrics["pg_dualclip_frac"] == 0.0


def test_huge_ratio_gives_finite_zero_gradient():
    # exp(100) overflows float32; the clipped branch must still give a clean zero gradient, not 0 * inf.
    logp = torch.tensor([[100.0]], requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), LossConfig())
    loss.backward()
    assert loss.item() == pytest.approx(-1.2) and logp.grad.item() == 0.0


@pytest.mark.parametrize("ratio, adv", [(1.1, 1.0), (0.9, -2.0), (1.5, -1.0), (5.0, -1.0)])
def test_weight_scales_gradient_exactly(ratio, adv):
    for cfg in (LossConfig(), LossConfig(eps_clip_c=3.0)):
        loss1, grad1, _ = one_token(ratio, adv, cfg)
        loss_w, grad_w, _ = one_token(ratio, adv, cfg, weight=0.37)
        assert loss_w == pytest.approx(0.37 * loss1, rel=1e-12)
        assert grad_w == pytest.approx(0.37 * grad1, rel=1e-12, abs=0)


# ------------------------------------------------------------------ aggregation
def ragged(seed, lengths, width):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(len(lengths), width, generator=gen, dtype=torch.float64)
    mask = torch.zeros(len(lengths), width, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    values[mask == 0] = NAN  # padding garbage must never leak
    return values, mask


def test_aggregation_modes_match_formulas():
    lengths, width = [3, 1, 0, 5], 6
    v, m = ragged(0, lengths, width)
    rows = [[v[i, t].item() for t in range(n)] for i, n in enumerate(lengths)]
    tokens = sum(lengths)
    kept_rows = [r for r in rows if r]
    assert aggregate(v, m, "token-mean").item() == pytest.approx(sum(map(sum, rows)) / tokens)
    assert aggregate(v, m, "seq-mean-token-mean").item() == pytest.approx(
        sum(sum(r) / len(r) for r in kept_rows) / len(kept_rows)
    )
    assert aggregate(v, m, "seq-mean-token-sum-norm", norm_len=8).item() == pytest.approx(
        sum(map(sum, rows)) / (len(kept_rows) * 8)
    )
    assert aggregate(v, m, "token-mean", num_tokens=100).item() == pytest.approx(sum(map(sum, rows)) / 100)
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(v, m, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="--loss-agg-mode"):
        aggregate(v, m, "sum")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_empty_mask_aggregates_to_graph_connected_zero(mode):
    v = torch.full((2, 3), NAN, requires_grad=True)
    out = aggregate(v, torch.zeros(2, 3), mode, norm_len=3)
    out.backward()
    assert out.item() == 0.0 and torch.equal(v.grad, torch.zeros(2, 3))


# ------------------------------------------------------------------ independent per-token reference
def reference_loss(logp, old, adv, mask, weights, ref, ent, cfg, num_seqs=None, num_tokens=None):
    """Plain python over ragged rows: the objective written token by token."""
    per_row = []
    for i in range(len(logp)):
        row = []
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            r = math.exp(logp[i][t] - old[i][t])
            a = adv[i]
            pg = max(-r * a, -min(max(r, 1 - cfg.eps_low), 1 + cfg.eps_high) * a)
            if cfg.eps_clip_c is not None and a < 0:
                pg = min(pg, -cfg.eps_clip_c * a)
            term = weights[i][t] * pg
            if cfg.use_kl_loss:
                d = ref[i][t] - logp[i][t]
                term += cfg.kl_loss_coef * (math.exp(d) - d - 1)
            term -= cfg.entropy_coef * ent[i][t]
            row.append(term)
        per_row.append(row)
    n_seqs = num_seqs if num_seqs is not None else sum(1 for r in per_row if r)
    n_tok = num_tokens if num_tokens is not None else sum(len(r) for r in per_row)
    if cfg.loss_agg_mode == "token-mean":
        return sum(map(sum, per_row)) / n_tok
    if cfg.loss_agg_mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in per_row if r) / n_seqs
    return sum(map(sum, per_row)) / (n_seqs * cfg.norm_len)


def random_batch(seed, batch=6, width=7):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, width, generator=gen, dtype=torch.float64) * 3
    logp = old + 0.3 * torch.randn(batch, width, generator=gen, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(batch, width, generator=gen, dtype=torch.float64)
    ent = torch.rand(batch, width, generator=gen, dtype=torch.float64)
    weights = 0.5 + torch.rand(batch, width, generator=gen, dtype=torch.float64)
    adv = torch.randn(batch, generator=gen, dtype=torch.float64)
    mask = torch.zeros(batch, width, dtype=torch.float64)
    for i in range(batch):
        mask[i, : rng.randint(0, width)] = 1  # ragged, some rows empty
        # holes inside a row, like rejected tokens
        if rng.random() < 0.5:
            mask[i, rng.randrange(width)] = 0
    for t in (old, logp, ref, ent, weights):
        t[mask == 0] = rng.choice([NAN, -INF])  # padding garbage
    return logp, old, adv, mask, weights, ref, ent


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("seed", range(3))
def test_policy_loss_matches_independent_reference(mode, seed):
    cfg = LossConfig(eps_clip=0.2, eps_clip_high=0.3, eps_clip_c=1.35, loss_agg_mode=mode, use_kl_loss=True,
                     kl_loss_coef=0.1, kl_loss_type="k3", entropy_coef=0.01, norm_len=9)
    logp, old, adv, mask, weights, ref, ent = random_batch(seed)
    loss, metrics = policy_loss(logp.requires_grad_(), old, adv, mask, cfg, weights=weights, logp_ref=ref, entropy=ent)
    lists = [x.tolist() for x in (logp.detach(), old, adv, mask, weights, ref, ent)]
    assert loss.item() == pytest.approx(reference_loss(*lists, cfg), rel=1e-10)
    assert metrics["loss"] == pytest.approx(loss.item())
    assert metrics["loss/all_rejected"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    # the batch really exercises both clips
    assert metrics["pg_clipfrac"] > 0 and metrics["pg_dualclip_frac"] > 0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_with_global_counts_sum_to_full_batch(mode):
    cfg = LossConfig(loss_agg_mode=mode, norm_len=7, use_kl_loss=True, kl_loss_coef=0.05)
    logp, old, adv, mask, weights, ref, ent = random_batch(11, batch=8)
    full_logp = logp.clone().requires_grad_()
    full, full_metrics = policy_loss(full_logp, old, adv, mask, cfg, weights=weights, logp_ref=ref)
    full.backward()

    num_seqs = float((mask.sum(-1) > 0).sum())
    num_tokens = float(mask.sum())
    split_logp = logp.clone().requires_grad_()
    total, clipfrac = 0.0, 0.0
    for s in (slice(0, 3), slice(3, 5), slice(5, 8)):
        part, part_metrics = policy_loss(split_logp[s], old[s], adv[s], mask[s], cfg, weights=weights[s],
                                         logp_ref=ref[s], num_seqs=num_seqs, num_tokens=num_tokens)
        part.backward()
        total += part.item()
        clipfrac += part_metrics["pg_clipfrac"]
    assert total == pytest.approx(full.item(), rel=1e-12)
    assert clipfrac == pytest.approx(full_metrics["pg_clipfrac"], rel=1e-12, abs=1e-15)
    torch.testing.assert_close(split_logp.grad, full_logp.grad)


def test_rejected_sequence_gets_exactly_zero_gradient():
    logp, old, adv, mask, weights, _, _ = random_batch(5)
    mask[1] = 0  # sequence 1 rejected by the correction
    old[1] = torch.tensor([NAN, -INF] * 3 + [NAN])
    logp = logp.clone()
    logp[1] = torch.linspace(-1, 0, logp.shape[1], dtype=torch.float64)
    for mode in AGG_MODES:
        x = logp.clone().requires_grad_()
        loss, _ = policy_loss(x, old, adv, mask, LossConfig(loss_agg_mode=mode, norm_len=7), weights=weights)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
        assert torch.equal(x.grad[1], torch.zeros_like(x.grad[1]))
        assert torch.equal(x.grad[mask == 0], torch.zeros_like(x.grad[mask == 0]))
        assert x.grad[mask > 0].abs().sum() > 0


def test_all_rejected_batch_is_zero_and_finite():
    logp = torch.full((2, 4), NAN, requires_grad=True)
    old = torch.full((2, 4), -INF)
    loss, metrics = policy_loss(logp, old, torch.ones(2), torch.zeros(2, 4), LossConfig())
    loss.backward()
    assert loss.item() == 0.0 and loss.requires_grad
    assert torch.equal(logp.grad, torch.zeros(2, 4))
    assert metrics["loss/all_rejected"] == 1.0 and metrics["pg_loss"] == 0.0


def test_metrics_hand_computed():
    # Two tokens of one sequence, A = 1: r = 1.1 (unclipped) and r = 1.5 (clipped).
    logp = torch.tensor([[math.log(1.1), math.log(1.5)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    ref = torch.tensor([[0.0, 0.1]], dtype=torch.float64)
    ent = torch.tensor([[0.5, 1.5]], dtype=torch.float64)
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1", entropy_coef=0.1)
    loss, m = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), cfg, logp_ref=ref, entropy=ent)
    pg = (-1.1 - 1.2) / 2
    kl = ((math.log(1.1) - 0.0) + (math.log(1.5) - 0.1)) / 2
    assert m["pg_loss"] == pytest.approx(pg)
    assert m["kl_loss"] == pytest.approx(kl)
    assert m["entropy_loss"] == pytest.approx(1.0)
    assert m["loss"] == pytest.approx(pg + 0.5 * kl - 0.1 * 1.0)
    assert m["pg_clipfrac"] == 0.5
    assert m["ppo_kl"] == pytest.approx(-(math.log(1.1) + math.log(1.5)) / 2)
    loss.backward()
    # d/dlogp: token 0: -1.1 / 2 + 0.5 * 1 / 2 ; token 1 (clipped): 0 + 0.5 * 1 / 2
    assert logp.grad.tolist() == [[pytest.approx(-0.55 + 0.25), pytest.approx(0.25)]]


def test_advantages_per_sequence_or_per_token_agree():
    logp, old, adv, mask, weights, _, _ = random_batch(7)
    a, _ = policy_loss(logp, old, adv, mask, LossConfig(), weights=weights)
    b, _ = policy_loss(logp, old, adv[:, None].expand_as(logp).clone(), mask, LossConfig(), weights=weights)
    assert a.item() == pytest.approx(b.item(), rel=1e-12)


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0, -30.0])
    ref = torch.tensor([-1.5, -1.0, -1.0])
    d = ref - logp
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), logp - ref)
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), 0.5 * (logp - ref) ** 2)
    k3 = torch.exp(d) - d - 1
    torch.testing.assert_close(kl_estimate(logp, ref, "k3")[:2], k3[:2])
    # past d = 20 (the third token: d = 29) the exponent is capped; slime's unguarded k3 reaches inf at d > 88
    capped = kl_estimate(torch.tensor([-30.0, -200.0]), torch.tensor([-1.0, -1.0]), "k3")
    assert capped.tolist() == pytest.approx([math.exp(20.0) - 21.0] * 2)
    low = kl_estimate(logp, ref, "low_var_kl")
    torch.testing.assert_close(low[:2], k3[:2])  # same estimator in range
    assert low[2].item() == 10.0 and k3[2].item() > 1e11  # verl's clamp on the far token
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    # verl also clamps the log ratio before exp: at d = 100 exp overflows float32, and without that
    # clamp the backward of the clamped result would be 0 * inf = NaN.
    far = torch.tensor([-101.0], requires_grad=True)
    out = kl_estimate(far, torch.tensor([-1.0]), "low_var_kl")
    out.backward()
    assert out.item() == 10.0 and far.grad.item() == 0.0


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(eps_clip=0.0), "--eps-clip"),
        (dict(eps_clip=1.0), "--eps-clip"),
        (dict(eps_clip_high=-0.1), "--eps-clip-high"),
        (dict(eps_clip_c=1.0), "--eps-clip-c"),
        (dict(loss_agg_mode="sum"), "--loss-agg-mode"),
        (dict(kl_loss_type="k4"), "--kl-loss-type"),
        (dict(kl_loss_coef=-1.0), "--kl-loss-coef"),
        (dict(entropy_coef=float("nan")), "--entropy-coef"),
        (dict(norm_len=0), "--norm-len"),
        (dict(loss_agg_mode="seq-mean-token-sum-norm"), "--norm-len"),
    ],
)
def test_config_validation_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        LossConfig(**kwargs).validate()


def test_missing_inputs_rejected():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="--use-kl-loss"):
        policy_loss(x, x, torch.ones(1), torch.ones(1, 2), LossConfig(use_kl_loss=True, kl_loss_coef=0.1))
    with pytest.raises(ValueError, match="--entropy-coef"):
        policy_loss(x, x, torch.ones(1), torch.ones(1, 2), LossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.ones(2), torch.ones(1, 2), LossConfig())
    with pytest.raises(ValueError, match="weights"):
        policy_loss(x, x, torch.ones(1), torch.ones(1, 2), LossConfig(), weights=torch.ones(2, 2))


def test_kl_at_coefficient_zero_needs_no_reference():
    """--use-kl-loss --kl-loss-coef 0 (slime's GRPO scripts): the same loss without pi_ref; given one, KL is logged."""
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(3, 5, generator=g)
    old, ref = logp - 0.1 * torch.rand(3, 5, generator=g), logp + 0.2
    adv, mask = torch.tensor([1.0, -0.5, 0.3]), torch.ones(3, 5)
    zero = LossConfig(use_kl_loss=True, kl_loss_coef=0.0)
    assert not zero.needs_ref and LossConfig(use_kl_loss=True, kl_loss_coef=1e-3).needs_ref
    plain, plain_metrics = policy_loss(logp, old, adv, mask, LossConfig())
    without, metrics = policy_loss(logp, old, adv, mask, zero)
    with_ref, logged = policy_loss(logp, old, adv, mask, zero, logp_ref=ref)
    assert torch.equal(without, plain) and torch.equal(with_ref, plain)
    assert metrics["kl_loss"] == 0.0 and logged["kl_loss"] > 0
