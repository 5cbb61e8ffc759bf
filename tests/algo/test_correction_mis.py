"""Sparsity correction, the MIS rules: hand values, an independent per-sequence re-derivation (the authors' loop),
non-finite inputs. The presets' values: test_correction_config.py."""
import math
import random

import pytest
import torch

from slime_sparse.algo import PRESETS, CorrectionConfig, sparsity_correction


# ---------------------------------------------------------------------------------------------
# Independent reference: plain python over ragged lists, one sequence at a time, the way the
# authors' compute_mis_weights loops (truncate mode + token-level rejection + raw-ratio veto +
# batch normalisation over the original mask).
# ---------------------------------------------------------------------------------------------
def reference_correction(old_rows, sparse_rows, *, is_weight, is_upper, low, high, veto, batch_norm, clamp=20.0):
    weights, masks, vetoed = [], [], []
    for old, sparse in zip(old_rows, sparse_rows):
        raw = [o - s for o, s in zip(old, sparse)]
        seq_vetoed = veto is not None and any(r < math.log(veto) for r in raw)
        w_row, m_row = [], []
        for r in raw:
            x = math.exp(min(max(r, -clamp), clamp))
            w = (min(x, is_upper) if is_upper is not None else x) if is_weight else 1.0
            keep = (low is None or x >= low) and (high is None or x <= high) and not seq_vetoed
            w_row.append(w)
            m_row.append(1.0 if keep else 0.0)
        weights.append(w_row)
        masks.append(m_row)
        vetoed.append(seq_vetoed)
    factor = 1.0
    if batch_norm:
        n = sum(len(w) for w in weights)
        mean = sum(sum(w) for w in weights) / max(n, 1)
        if mean > 1e-8:
            factor = mean
            weights = [[w / mean for w in row] for row in weights]
    return weights, masks, vetoed, factor


def random_ragged_batch(seed, batch=12, max_len=20, spread=0.4):
    """log-prob rows with ragged lengths; a few tokens get large mismatches to hit every rule."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, max_len) for _ in range(batch)]
    old_rows, sparse_rows = [], []
    for n in lengths:
        old = [-rng.expovariate(1.0) for _ in range(n)]
        sparse = [o + rng.gauss(0.0, spread) for o in old]
        for _ in range(rng.randint(0, 2)):  # catastrophic / large tokens
            t = rng.randrange(n)
            sparse[t] = old[t] + rng.choice([12.0, -3.0, 25.0, 1.0])
        old_rows.append(old)
        sparse_rows.append(sparse)
    return old_rows, sparse_rows, lengths


def pad(rows, width, fill):
    return torch.tensor([row + [fill] * (width - len(row)) for row in rows], dtype=torch.float64)


def to_padded(old_rows, sparse_rows, lengths, fill=float("-inf")):
    width = max(lengths) + 2  # extra padding columns on purpose
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths], dtype=torch.float64)
    # Padding holds -inf (what a log-prob gather of a pad token can give): must be ignored.
    return pad(old_rows, width, fill), pad(sparse_rows, width, fill), mask


def check_against_reference(cfg, seed):
    old_rows, sparse_rows, lengths = random_ragged_batch(seed)
    old, sparse, mask = to_padded(old_rows, sparse_rows, lengths)
    res = sparsity_correction(old, sparse, mask, cfg)
    ref_w, ref_m, ref_vetoed, ref_factor = reference_correction(
        old_rows, sparse_rows, is_weight=cfg.is_weight, is_upper=cfg.is_upper, low=cfg.token_mask_low,
        high=cfg.token_mask_high, veto=cfg.seq_veto, batch_norm=cfg.batch_normalize,
    )
    width = mask.shape[1]
    torch.testing.assert_close(res.weights, pad(ref_w, width, 0.0), rtol=1e-12, atol=0)
    torch.testing.assert_close(res.mask, pad(ref_m, width, 0.0), rtol=0, atol=0)
    assert res.seq_kept.tolist() == [any(m) for m in ref_m]
    assert res.metrics["correction/batch_norm_factor"] == pytest.approx(ref_factor, rel=1e-12)
    assert res.metrics["correction/veto_seqs"] == sum(ref_vetoed)
    n_tok = sum(lengths)
    assert res.metrics["correction/token_reject_rate"] == pytest.approx(1 - sum(map(sum, ref_m)) / n_tok)
    assert res.metrics["correction/seq_reject_rate"] == pytest.approx(sum(not any(m) for m in ref_m) / len(lengths))
    return res, ref_vetoed


@pytest.mark.parametrize("seed", range(6))
def test_mis_preset_matches_per_sequence_reference(seed):
    cfg = CorrectionConfig.from_preset("mis")
    res, vetoed = check_against_reference(cfg, seed)
    assert torch.isfinite(res.weights).all() and torch.isfinite(res.mask).all()


@pytest.mark.parametrize("seed", range(6))
def test_paper_preset_matches_per_sequence_reference(seed):
    check_against_reference(CorrectionConfig.from_preset("paper"), seed)


@pytest.mark.parametrize("seed", range(3))
def test_custom_knobs_match_reference(seed):
    cfg = CorrectionConfig(is_weight=True, is_upper=2.0, token_mask_low=0.2, seq_veto=1e-3, batch_normalize=True)
    check_against_reference(cfg, seed)
    check_against_reference(CorrectionConfig(token_mask_high=1.3), seed)


def test_reference_exercises_every_rule():
    """The random batches above must actually hit truncation, both token masks and the veto."""
    hits = {"veto": 0, "trunc": 0, "low": 0, "high": 0}
    for seed in range(6):
        old_rows, sparse_rows, lengths = random_ragged_batch(seed)
        res = sparsity_correction(*to_padded(old_rows, sparse_rows, lengths), CorrectionConfig.from_preset("mis"))
        hits["veto"] += res.metrics["correction/veto_seqs"]
        hits["trunc"] += res.metrics["correction/truncate_frac"]
        hits["low"] += res.metrics["correction/mask_low_frac"]
        hits["high"] += res.metrics["correction/mask_high_frac"]
    assert all(v > 0 for v in hits.values()), hits


def test_mis_hand_computed():
    # Row 0 log xi: [0, log 2, log 0.4, log 1.2]; row 1: [log 1.1, log 1e-5] (vetoed), 1 padding.
    log_xi = torch.tensor([[0.0, math.log(2), math.log(0.4), math.log(1.2)], [math.log(1.1), math.log(1e-5), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
    old = torch.full_like(log_xi, -1.0)
    res = sparsity_correction(old, old - log_xi, mask, CorrectionConfig.from_preset("mis"))
    # truncated weights: [1, 1.5, 0.4, 1.2], [1.1, 1e-5]; mean over 6 original tokens (vetoed ones included)
    raw = [1.0, 1.5, 0.4, 1.2, 1.1, 1e-5]
    mean = sum(raw) / 6
    expected_w = torch.tensor([[1.0, 1.5, 0.4, 1.2], [1.1, 1e-5, 0, 0]]) / mean
    torch.testing.assert_close(res.weights, expected_w * mask)
    # token mask: 2 > 1.5 and 0.4 < 0.5 rejected; row 1 vetoed whole
    assert res.mask.tolist() == [[1, 0, 0, 1], [0, 0, 0, 0]]
    assert res.seq_kept.tolist() == [True, False]
    m = res.metrics
    assert m["correction/batch_norm_factor"] == pytest.approx(mean, rel=1e-6)
    assert m["correction/token_reject_rate"] == pytest.approx(4 / 6)
    assert m["correction/seq_reject_rate"] == pytest.approx(1 / 2)
    assert m["correction/veto_seqs"] == 1.0 and m["correction/veto_token_frac"] == pytest.approx(1 / 6)
    assert m["correction/truncate_frac"] == pytest.approx(1 / 6)
    assert m["correction/mask_low_frac"] == pytest.approx(2 / 6)  # 0.4 and 1e-5
    assert m["correction/mask_high_frac"] == pytest.approx(1 / 6)
    assert m["correction/xi_min"] == pytest.approx(1e-5, rel=1e-4)
    assert m["correction/xi_max"] == pytest.approx(2.0, rel=1e-6)
    assert m["correction/xi_mean"] == pytest.approx((1 + 2 + 0.4 + 1.2 + 1.1 + 1e-5) / 6, rel=1e-6)
    assert m["correction/weight_mean"] == pytest.approx((1.0 + 1.2) / 2 / mean, rel=1e-6)
    assert m["correction/nonfinite_seqs"] == 0.0 and m["correction/seqs"] == 2.0


def test_paper_preset_hand_computed():
    log_xi = torch.tensor([[math.log(3.0), math.log(0.2)], [math.log(5e-5), 0.0]])
    old = torch.zeros(2, 2)
    res = sparsity_correction(old, old - log_xi, torch.ones(2, 2), CorrectionConfig.from_preset("paper"))
    torch.testing.assert_close(res.weights, torch.tensor([[3.0, 0.2], [5e-5, 1.0]]))  # no truncation
    assert res.mask.tolist() == [[1, 1], [0, 0]]
    assert res.metrics["correction/batch_norm_factor"] == 1.0


def test_none_preset_is_identity():
    gen = torch.Generator().manual_seed(1)
    old, sparse = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen) * 10
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.float32)
    res = sparsity_correction(old, sparse, mask, CorrectionConfig.from_preset("none"))
    assert torch.equal(res.weights, mask) and torch.equal(res.mask, mask)
    assert res.seq_kept.tolist() == [True, True, False]
    assert res.metrics["correction/seq_reject_rate"] == 0.0 and res.metrics["correction/seqs"] == 2.0


def test_veto_uses_raw_unclamped_ratio():
    # log xi = -30 is clamped to -20 for the weight, but the veto at 1e-10 (log = -23) must see -30.
    old = torch.tensor([[0.0, 0.0]])
    sparse = torch.tensor([[30.0, 0.0]])
    cfg = CorrectionConfig(is_weight=True, seq_veto=1e-10)
    res = sparsity_correction(old, sparse, torch.ones(1, 2), cfg)
    assert res.mask.tolist() == [[0.0, 0.0]]
    assert res.weights[0, 0].item() == pytest.approx(math.exp(-20.0), rel=1e-5)
    # A veto token sitting in the padding is ignored.
    res = sparsity_correction(old, sparse, torch.tensor([[0.0, 1.0]]), cfg)
    assert res.mask.tolist() == [[0.0, 1.0]] and res.metrics["correction/veto_seqs"] == 0.0


def test_batch_norm_skipped_when_mean_tiny():
    old = torch.zeros(1, 3)
    sparse = torch.full((1, 3), 25.0)  # xi clamped to e^-20 ~ 2e-9 < 1e-8
    cfg = CorrectionConfig(is_weight=True, batch_normalize=True)
    res = sparsity_correction(old, sparse, torch.ones(1, 3), cfg)
    assert res.metrics["correction/batch_norm_factor"] == 1.0
    torch.testing.assert_close(res.weights, torch.full((1, 3), math.exp(-20.0)))


def test_batch_norm_reduce_gives_global_mean():
    old_rows, sparse_rows, lengths = random_ragged_batch(3)
    old, sparse, mask = to_padded(old_rows, sparse_rows, lengths)
    cfg = CorrectionConfig.from_preset("mis")
    full = sparsity_correction(old, sparse, mask, cfg)
    half = len(lengths) // 2
    shards = [slice(0, half), slice(half, None)]
    local_stats = []
    for s in shards:  # what each "rank" would contribute to an all-reduce
        w = sparsity_correction(old[s], sparse[s], mask[s], CorrectionConfig.from_preset("mis", batch_normalize=False))
        local_stats.append(torch.stack([w.weights.sum(), mask[s].sum()]))
    total = local_stats[0] + local_stats[1]
    for s in shards:
        part = sparsity_correction(old[s], sparse[s], mask[s], cfg, batch_norm_reduce=lambda stats: total)
        torch.testing.assert_close(part.weights, full.weights[s])
        torch.testing.assert_close(part.mask, full.mask[s])


def test_nonfinite_inputs_rejected_and_counted():
    nan, inf = float("nan"), float("inf")
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, nan, -1.0], [-1.0, -1.0, -inf], [-0.5, -0.5, -0.5]])
    sparse = torch.tensor([[-1.2, -inf, -0.9], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-0.5, -0.4, nan]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.float32)  # row 3: NaN in padding
    for preset in PRESETS:
        res = sparsity_correction(old, sparse, mask, CorrectionConfig.from_preset(preset))
        assert torch.isfinite(res.weights).all() and torch.isfinite(res.mask).all()
        assert all(math.isfinite(v) for v in res.metrics.values()), res.metrics
        assert res.metrics["correction/nonfinite_seqs"] == 3.0
        assert res.seq_kept.tolist() == [False, False, False, True]
        assert res.weights[:3].abs().sum() == 0 and res.mask[:3].sum() == 0
        assert res.metrics["correction/token_reject_rate"] == pytest.approx(9 / 11)
    # Non-finite sequences stay out of the normalisation mean: row 3 alone decides it.
    res = sparsity_correction(old, sparse, mask, CorrectionConfig.from_preset("mis"))
    w3 = [1.0, min(math.exp(-0.1), 1.5)]
    assert res.metrics["correction/batch_norm_factor"] == pytest.approx(sum(w3) / 2, rel=1e-6)
    assert res.metrics["correction/veto_seqs"] == 0.0  # the -inf old log-prob is counted as non-finite, not vetoed


def test_bool_and_float_masks_agree_and_outputs_are_detached():
    gen = torch.Generator().manual_seed(2)
    old = torch.randn(4, 6, generator=gen, requires_grad=True)
    sparse = old.detach() + 0.3 * torch.randn(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.3
    cfg = CorrectionConfig.from_preset("mis")
    a = sparsity_correction(old, sparse, mask, cfg)
    b = sparsity_correction(old, sparse, mask.float(), cfg)
    assert torch.equal(a.weights, b.weights) and torch.equal(a.mask, b.mask)
    assert not a.weights.requires_grad and a.mask.dtype == torch.float32


def test_empty_batch_metrics_are_finite():
    res = sparsity_correction(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), CorrectionConfig.from_preset("mis"))
    assert res.mask.sum() == 0 and not res.seq_kept.any()
    assert all(math.isfinite(v) for v in res.metrics.values())


def test_shape_mismatch_rejected():
    with pytest.raises(ValueError, match="shape"):
        sparsity_correction(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), CorrectionConfig())
