"""The rollout-correction algebra against an oracle written from the definitions (verl's rollout_corr docs, slime's
MIS helper README, DeepSeek-V3.2's OPSM), one sequence at a time in plain python: every level, mode and rejection
statistic, the veto, OPSM, batch normalisation; empty masks, length-1 responses, all-rejected batches; adversarial
batches through every preset. The presets, validation and old configs: test_correction_config.py; the MIS rules
against the authors' per-sequence loop and hand values: test_correction_mis.py."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from slime_sparse.algo import ALL_PRESETS, RS_OPTIONS, VERL_PRESETS, CorrectionConfig, sparsity_correction

CLAMP = 20.0


def knobs_of(cfg: CorrectionConfig) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "preset"}


def clamp(x: float) -> float:
    return min(max(x, -CLAMP), CLAMP)


# ------------------------------------------------------------------------------------------------ the oracle
def k_estimate(kind: str, l: float) -> float:
    """KL(pi_sparse || pi_old) estimators from l = log(pi_old / pi_sparse), clamped (verl's token_k1..k3)."""
    lc = clamp(l)
    return {"k1": -lc, "k2": 0.5 * lc * lc, "k3": math.exp(lc) - 1.0 - lc}[kind]


def rule_passes(option: str, threshold: str, row: list[float]) -> list[bool]:
    """verl's rollout_rs option on one sequence: per token, does it survive? k1: exp(statistic) within the
    "lower_upper" ratio bounds (one number U: [1/U, U]); k2 / k3: statistic <= the bound."""
    where, kind = option.rsplit("_", 1)
    values = [k_estimate(kind, l) for l in row]
    if not row:
        return []
    if where == "token":
        stats = values
    else:
        agg = {"seq_sum": sum(values), "seq_mean": sum(values) / len(values), "seq_max": max(values)}[where]
        stats = [agg] * len(row)
    if kind == "k1":
        parts = [float(x) for x in threshold.split("_")]
        low, high = parts if len(parts) == 2 else (1 / parts[0], parts[0])
        return [low <= math.exp(s) <= high for s in stats]
    return [s <= float(threshold) for s in stats]


def oracle(old_rows, sparse_rows, knobs: dict, advantages=None):
    """(weights, masks, batch_norm_factor) of ragged rows under the knobs (CorrectionConfig field names)."""
    k = {**knobs_of(CorrectionConfig()), **knobs}
    weights, masks = [], []
    for i, (old, sparse) in enumerate(zip(old_rows, sparse_rows)):
        raw = [o - s for o, s in zip(old, sparse)]
        n = len(raw)
        level = {"token": raw, "sequence": [sum(raw)] * n, "geometric": [sum(raw) / max(n, 1)] * n}[k["is_level"]]
        ratio = [math.exp(clamp(v)) for v in level]
        if k["is_weight"]:
            upper = math.inf if k["is_upper"] is None else k["is_upper"]
            w = [min(max(r, k["is_lower"]), upper) if k["is_mode"] == "truncate" else r for r in ratio]
            if k["is_mode"] == "icepop":  # verl's "lower_upper" threshold: 0 outside the band, the mask untouched
                w = [r if k["is_lower"] <= r <= upper else 0.0 for r in ratio]
        else:
            w = [1.0] * n
        keep = [True] * n
        if k["is_weight"] and k["is_mode"] == "mask":
            keep = [kp and k["is_lower"] <= r <= k["is_upper"] for kp, r in zip(keep, ratio)]
        for t, l in enumerate(raw):
            xi = math.exp(clamp(l))
            if k["token_mask_low"] is not None and xi < k["token_mask_low"]:
                keep[t] = False
            if k["token_mask_high"] is not None and xi > k["token_mask_high"]:
                keep[t] = False
        thresholds = k["rs_threshold"] * len(k["rs"]) if len(k["rs_threshold"]) == 1 else k["rs_threshold"]
        for option, threshold in zip(k["rs"], thresholds):
            keep = [kp and ok for kp, ok in zip(keep, rule_passes(option, threshold, raw))]
        if k["seq_veto"] is not None and any(l < math.log(k["seq_veto"]) for l in raw):
            keep = [False] * n
        if k["opsm_delta"] is not None and n and advantages[i] < 0 and -sum(raw) / n > k["opsm_delta"]:
            keep = [False] * n
        weights.append(w)
        masks.append([1.0 if kp else 0.0 for kp in keep])
    factor = 1.0
    if k["batch_normalize"]:
        if k["is_level"] == "token":
            flat = [x for row in weights for x in row]
        else:  # one weight per sequence
            flat = [row[0] for row in weights if row]
        mean = sum(flat) / max(len(flat), 1)
        if mean > 1e-8:
            factor = mean
            weights = [[x / mean for x in row] for row in weights]
    return weights, masks, factor


# ------------------------------------------------------------------------------------------------ batches
def ragged_batch(seed: int, *, batch: int = 10, max_len: int = 12, spread: float = 0.3):
    """Ragged rows (lengths 1..max_len, some length 1) with a few large mismatches, and advantages of both signs."""
    rng = random.Random(seed)
    lengths = [rng.choice([1, rng.randint(1, max_len)]) for _ in range(batch)]
    old_rows, sparse_rows = [], []
    for n in lengths:
        old = [-rng.expovariate(1.0) for _ in range(n)]
        sparse = [o + rng.gauss(0.0, spread) for o in old]
        if rng.random() < 0.4:
            t = rng.randrange(n)
            sparse[t] = old[t] + rng.choice([12.0, -2.0, 25.0, 0.8])
        old_rows.append(old)
        sparse_rows.append(sparse)
    advantages = [rng.choice([-1.0, 1.0, 0.0, -0.3]) for _ in range(batch)]
    return old_rows, sparse_rows, lengths, advantages


def padded(rows, width, fill):
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.float64)


def run_against_oracle(knobs: dict, seed: int, **batch_kw):
    old_rows, sparse_rows, lengths, adv = ragged_batch(seed, **batch_kw)
    width = max(lengths) + 1  # a padding column everywhere, holding garbage
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths], dtype=torch.float64)
    cfg = CorrectionConfig(**knobs)
    res = sparsity_correction(padded(old_rows, width, float("nan")), padded(sparse_rows, width, -math.inf), mask, cfg,
                              advantages=torch.tensor(adv))
    want_w, want_m, factor = oracle(old_rows, sparse_rows, knobs, adv)
    torch.testing.assert_close(res.weights, padded(want_w, width, 0.0), rtol=1e-12, atol=0)
    assert res.mask.tolist() == padded(want_m, width, 0.0).tolist()
    assert res.seq_kept.tolist() == [any(m) for m in want_m]
    assert res.metrics["correction/batch_norm_factor"] == pytest.approx(factor, rel=1e-12)
    n_tok = sum(lengths)
    assert res.metrics["correction/token_reject_rate"] == pytest.approx(1 - sum(map(sum, want_m)) / n_tok)
    assert res.metrics["correction/seq_reject_rate"] == pytest.approx(sum(not any(m) for m in want_m) / len(lengths))
    assert all(math.isfinite(v) for v in res.metrics.values())
    return res, want_m


LEVELS_AND_MODES = [
    dict(is_weight=True, is_level=level, is_upper=upper, is_lower=lower, is_mode=mode, batch_normalize=norm)
    for level, upper in (("token", 1.5), ("sequence", 2.0), ("geometric", 1.05))
    for mode, lower in (("truncate", 0.0), ("truncate", 0.8), ("mask", 0.5))
    for norm in (False, True)
]


@pytest.mark.parametrize("knobs", LEVELS_AND_MODES, ids=lambda k: f"{k['is_level']}-{k['is_mode']}-low{k['is_lower']}"
                                                                  f"-norm{int(k['batch_normalize'])}")
@pytest.mark.parametrize("seed", range(3))
def test_levels_and_modes_match_the_oracle(knobs, seed):
    run_against_oracle(knobs, seed)


def threshold_for(option: str) -> str:
    """A threshold that rejects some but not all of the test batches' tokens / sequences."""
    where, kind = option.rsplit("_", 1)
    if kind == "k1":
        return {"token": "0.7_1.5", "seq_sum": "0.3_4.0", "seq_mean": "0.8_1.2", "seq_max": ""}[where]
    scale = {"token": 0.1, "seq_sum": 0.8, "seq_mean": 0.1, "seq_max": 0.2}[where]
    return str(scale if kind == "k2" else scale * 0.8)


@pytest.mark.parametrize("option", RS_OPTIONS)
@pytest.mark.parametrize("seed", range(3))
def test_each_rejection_statistic_matches_the_oracle(option, seed):
    res, want_m = run_against_oracle(dict(rs=(option,), rs_threshold=(threshold_for(option),)), seed)
    n_seq = len(want_m)
    key = f"correction/rs_{option}_seq_frac"
    assert res.metrics[key] == pytest.approx(sum(not all(m) for m in want_m) / n_seq)


def test_the_statistics_reject_something_and_keep_something():
    """The thresholds above are informative: over the test seeds each statistic rejects and keeps."""
    for option in RS_OPTIONS:
        rates = [run_against_oracle(dict(rs=(option,), rs_threshold=(threshold_for(option),)), seed)[0]
                 .metrics["correction/token_reject_rate"] for seed in range(3)]
        assert 0 < sum(rates) < 3, (option, rates)


def test_k1_bounds_are_verls_orientation():
    """verl's k1 statistic is -log(pi_old / pi_rollout) and its 'lower_upper' bounds apply to exp(k1): '0.6_1.4'
    keeps xi = pi_old / pi_sparse in [1/1.4, 1/0.6] = [0.714, 1.667]."""
    xi = torch.tensor([[0.70], [0.72], [1.3], [1.6], [1.7]])
    cfg = CorrectionConfig(rs=("token_k1",), rs_threshold=("0.6_1.4",))
    kept = sparsity_correction(torch.log(xi), torch.zeros_like(xi), torch.ones_like(xi), cfg).seq_kept.tolist()
    assert kept == [False, True, True, True, False]
    one = CorrectionConfig(rs=("token_k1",), rs_threshold=("2.0",))  # one number U: [1/U, U]
    kept = sparsity_correction(torch.log(torch.tensor([[0.49], [0.51], [1.99], [2.01]])), torch.zeros(4, 1),
                               torch.ones(4, 1), one).seq_kept.tolist()
    assert kept == [False, True, True, False]


def test_several_statistics_must_all_pass():
    knobs = dict(rs=("token_k1", "seq_max_k2", "seq_mean_k3"), rs_threshold=("0.7_1.5", "0.2", "0.05"))
    for seed in range(3):
        run_against_oracle(knobs, seed)
    run_against_oracle(dict(rs=("token_k2", "seq_sum_k3"), rs_threshold=("0.1",)), 0)  # one threshold for all


def test_hand_computed_sequence_statistics():
    # one sequence, l = log xi = [log 2, log 0.5, 0]: sum 0, mean 0; k2 max = (log 2)^2 / 2 = 0.240
    l = torch.tensor([[math.log(2.0), math.log(0.5), 0.0]])
    old, sparse, mask = l, torch.zeros_like(l), torch.ones_like(l)
    keep = lambda opt, thr: bool(sparsity_correction(old, sparse, mask, CorrectionConfig(  # noqa: E731
        rs=(opt,), rs_threshold=(thr,))).seq_kept[0])
    assert keep("seq_sum_k1", "0.999_1.001") and keep("seq_mean_k1", "0.999_1.001")  # the product of ratios is 1
    assert keep("seq_max_k2", "0.25") and not keep("seq_max_k2", "0.23")
    k3 = ((2 - 1 - math.log(2)) + (0.5 - 1 - math.log(0.5))) / 3  # 1/6: (0.307 + 0.193 + 0) / 3
    assert keep("seq_mean_k3", "0.167") and not keep("seq_mean_k3", "0.166")
    assert keep("seq_sum_k3", str(3 * k3 + 1e-4)) and not keep("seq_sum_k3", str(3 * k3 - 1e-4))
    # the geometric mean of xi (seq_mean_k1) against the sequence product (seq_sum_k1), one token of ratio 0.5
    l = torch.tensor([[math.log(0.5), 0.0, 0.0, 0.0]])
    geo = CorrectionConfig(rs=("seq_mean_k1",), rs_threshold=("1.2",))  # exp(-mean l) = 2^(1/4) = 1.19 <= 1.2
    seq = CorrectionConfig(rs=("seq_sum_k1",), rs_threshold=("1.2",))  # exp(-sum l) = 2 > 1.2
    assert bool(sparsity_correction(l, torch.zeros_like(l), torch.ones_like(l), geo).seq_kept[0])
    assert not bool(sparsity_correction(l, torch.zeros_like(l), torch.ones_like(l), seq).seq_kept[0])


def test_veto_and_opsm_match_the_oracle():
    for seed in range(4):
        run_against_oracle(dict(is_weight=True, seq_veto=1e-3), seed)
        run_against_oracle(dict(opsm_delta=0.05), seed)
        run_against_oracle(dict(is_weight=True, is_upper=1.5, token_mask_low=0.5, token_mask_high=1.5, seq_veto=1e-4,
                                opsm_delta=0.0, rs=("seq_max_k3",), rs_threshold=("3.0",), batch_normalize=True), seed)


def test_opsm_hand_computed():
    """slime's OPSM: mask a sequence iff its advantage < 0 and mean log(pi_behaviour / pi_current) > delta."""
    # per-row mean of log(pi_sparse / pi_old): 0.2, 0.2, 0.05, 0.2
    sparse = torch.tensor([[0.3, 0.1], [0.2, 0.2], [0.05, 0.05], [0.4, 0.0]])
    adv = torch.tensor([-1.0, 1.0, -1.0, -0.1])
    res = sparsity_correction(torch.zeros(4, 2), sparse, torch.ones(4, 2), CorrectionConfig(opsm_delta=0.1),
                              advantages=adv)
    assert res.seq_kept.tolist() == [False, True, True, False]
    assert res.metrics["correction/opsm_seq_frac"] == 0.5
    with pytest.raises(ValueError, match="--correction-opsm-delta needs the \\[B\\] per-sequence advantages"):
        sparsity_correction(torch.zeros(4, 2), sparse, torch.ones(4, 2), CorrectionConfig(opsm_delta=0.1))


def test_weight_statistics_are_their_definitions():
    """is_mean / is_std / is_ess of the weights before normalisation, token-weighted; ESS = (sum w)^2 / (n sum w^2)."""
    old_rows, sparse_rows, lengths, _ = ragged_batch(5)
    width = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths], dtype=torch.float64)
    for knobs in (dict(is_weight=True, is_upper=2.0), dict(is_weight=True, is_level="sequence", is_upper=3.0,
                                                            batch_normalize=True)):
        res = sparsity_correction(padded(old_rows, width, 0.0), padded(sparse_rows, width, 0.0), mask,
                                  CorrectionConfig(**knobs))
        w = [x for row in oracle(old_rows, sparse_rows, {**knobs, "batch_normalize": False})[0] for x in row]
        n, s1, s2 = len(w), sum(w), sum(x * x for x in w)
        m = res.metrics
        assert m["correction/is_mean"] == pytest.approx(s1 / n, rel=1e-9)
        assert m["correction/is_std"] == pytest.approx(math.sqrt(max(s2 / n - (s1 / n) ** 2, 0)), rel=1e-6)
        assert m["correction/is_ess"] == pytest.approx(s1 * s1 / (n * s2), rel=1e-9)
        assert 0 < m["correction/is_ess"] < 1
    none = sparsity_correction(padded(old_rows, width, 0.0), padded(sparse_rows, width, 0.0), mask, CorrectionConfig())
    assert (none.metrics["correction/is_mean"], none.metrics["correction/is_std"], none.metrics["correction/is_ess"]) \
        == (1.0, 0.0, 1.0)


def test_veto_fractions():
    """verl's rollout_is_veto_fraction (sequences) and catastrophic token fraction (tokens below the veto)."""
    l = torch.tensor([[math.log(1e-5), 0.0, 0.0], [0.0, 0.0, 0.0], [math.log(1e-6), math.log(1e-7), 0.0],
                      [0.0, 0.0, 0.0]])
    res = sparsity_correction(l, torch.zeros_like(l), torch.ones_like(l), CorrectionConfig(seq_veto=1e-4))
    assert res.metrics["correction/veto_seq_frac"] == 0.5 and res.metrics["correction/veto_seqs"] == 2.0
    assert res.metrics["correction/veto_token_frac"] == pytest.approx(3 / 12)


# ------------------------------------------------------------------------------------------------ edge cases
EDGE_CONFIGS = [CorrectionConfig.from_preset(name) for name in ALL_PRESETS] + [
    CorrectionConfig(**knobs) for knobs in LEVELS_AND_MODES[::3]] + [CorrectionConfig(opsm_delta=0.0)]


@pytest.mark.parametrize("cfg", EDGE_CONFIGS, ids=lambda c: c.preset if c.preset != "custom" else
                         f"{c.is_level}-{c.is_mode}")
def test_empty_masks_length_one_and_all_rejected(cfg):
    adv = torch.tensor([-1.0, 1.0, -1.0])
    # an empty batch: nothing kept, metrics finite
    res = sparsity_correction(torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(3, 4), cfg, advantages=adv)
    assert res.mask.sum() == 0 and not res.seq_kept.any() and res.weights.abs().sum() == 0
    assert all(math.isfinite(v) for v in res.metrics.values()) and res.metrics["correction/seqs"] == 0
    # length-1 responses next to an empty row, against the oracle
    old_rows, sparse_rows = [[-0.5], [], [-2.0]], [[-0.6], [], [-1.0]]
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    res = sparsity_correction(padded(old_rows, 2, 0.0), padded(sparse_rows, 2, 0.0), mask, cfg, advantages=adv)
    knobs = knobs_of(cfg)
    want_w, want_m, _ = oracle(old_rows, sparse_rows, knobs, adv.tolist())
    torch.testing.assert_close(res.weights, padded(want_w, 2, 0.0), rtol=1e-12, atol=0)
    assert res.mask.tolist() == padded(want_m, 2, 0.0).tolist()
    assert res.metrics["correction/seqs"] == 2
    # every sequence vetoed or non-finite: all rejected, counted, nothing non-finite out
    old = torch.tensor([[-1.0, -1.0], [-1.0, float("nan")], [-1.0, -1.0]])
    sparse = torch.tensor([[-1.0, 40.0], [-1.0, -1.0], [30.0, -1.0]])
    vetoing = CorrectionConfig(**{**knobs, "seq_veto": 1e-4})
    res = sparsity_correction(old, sparse, torch.ones(3, 2), vetoing, advantages=adv)
    assert not res.seq_kept.any() and res.metrics["correction/seq_reject_rate"] == 1.0
    assert res.metrics["correction/token_reject_rate"] == 1.0 and res.metrics["correction/nonfinite_seqs"] == 1
    assert torch.isfinite(res.weights).all() and all(math.isfinite(v) for v in res.metrics.values())



# ------------------------------------------------------------------------------------------------ fuzz
@pytest.mark.parametrize("block", range(2))
def test_fuzz_every_preset_and_mode_counts_its_rejections(block):
    """tests/algo/test_fuzz_objective.py's adversarial batches (non-finite, huge, empty, length 1) through verl's
    presets and the new levels / modes / OPSM: nothing non-finite out, every rejection counted, non-finite sequences
    out."""
    from tests.algo.test_fuzz_objective import adversarial_case, check_rejections_counted

    configs = [CorrectionConfig.from_preset(name) for name in VERL_PRESETS] + [
        CorrectionConfig(**knobs) for knobs in LEVELS_AND_MODES] + [
        CorrectionConfig(opsm_delta=0.01, seq_veto=1e-4, rs=("seq_max_k2", "token_k1"), rs_threshold=("2.0",))]
    for seed in range(block * 20, (block + 1) * 20):
        case = adversarial_case(seed)
        for cfg in configs:
            res = sparsity_correction(case.logp_old, case.logp_sparse, case.mask, cfg, advantages=case.rewards - 0.5)
            where = f"seed {seed} {cfg.preset} {cfg.is_level} {cfg.is_mode}"
            assert all(math.isfinite(v) for v in res.metrics.values()), where
            check_rejections_counted(case, res, cfg.preset, where)
