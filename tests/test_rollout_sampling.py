"""Sampling params and the pure logits -> token / log-prob functions, against hand-computed references."""
import math

import pytest
import torch

from slime_sparse.rollout.sampling import (
    SamplingParams,
    apply_top_k,
    apply_top_p,
    derive_seed,
    inverse_cdf_sample,
    sample_next,
    sampler_logprobs,
)


def test_top_k_keeps_k_largest_and_ties():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 2.0, 2.0, 0.0, 2.0]])
    out = apply_top_k(logits, 2)
    neg = float("-inf")
    assert out[0].tolist() == [neg, 5.0, neg, 4.0, neg]
    assert out[1].tolist() == [neg, 2.0, 2.0, neg, 2.0]  # three-way tie at the 2nd value: all survive
    assert torch.equal(apply_top_k(logits, -1), logits)
    assert torch.equal(apply_top_k(logits, 5), logits)


def test_top_p_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.1, 0.3, 0.05, 0.05]])
    logits = probs.log()
    # sorted: 0.5, 0.3, 0.1, ... ; mass before: 0, 0.5, 0.8 -> p=0.75 keeps {0.5, 0.3}; p=0.8 keeps 3 tokens
    kept = torch.isfinite(apply_top_p(logits, 0.75))[0].tolist()
    assert kept == [True, False, True, False, False]
    kept = torch.isfinite(apply_top_p(logits, 0.81))[0].tolist()
    assert kept == [True, True, True, False, False]
    # the top token always survives, however small p is
    assert torch.isfinite(apply_top_p(logits, 1e-6))[0].tolist() == [True, False, False, False, False]
    assert torch.equal(apply_top_p(logits, 1.0), logits)


def test_logprob_is_tempered_and_untruncated():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    params = SamplingParams(temperature=0.7, top_k=1)  # truncation leaves only token 0
    gen = torch.Generator().manual_seed(0)
    tokens, logp = sample_next(logits, params, [gen])
    assert tokens.tolist() == [0]
    expected = 2.0 / 0.7 - math.log(sum(math.exp(x / 0.7) for x in [2.0, 1.0, 0.5, -1.0]))
    assert logp.item() == pytest.approx(expected, abs=1e-6)  # not 0.0 (= log of the truncated distribution)


def test_greedy_uses_untempered_softmax():
    logits = torch.tensor([[0.1, 3.0, 1.0], [2.0, -1.0, 2.5]])
    tokens, logp = sample_next(logits, SamplingParams(temperature=0.0), None)
    assert tokens.tolist() == [1, 2]
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(logp, torch.stack([ref[0, 1], ref[1, 2]]))
    assert torch.allclose(sampler_logprobs(logits, 0.0), ref)


def test_sampling_frequencies_follow_truncated_distribution():
    logits = torch.tensor([[1.0, 0.0, -0.5, -3.0]])
    params = SamplingParams(temperature=1.0, top_p=0.9)
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(4)
    for _ in range(4000):
        tok, _ = sample_next(logits, params, [gen])
        counts[tok] += 1
    p = torch.softmax(logits[0], -1)  # [0.61, 0.22, 0.14, 0.03]: mass before token 3 is 0.97 >= 0.9 -> dropped
    expected = p[:3] / p[:3].sum()
    assert counts[3] == 0
    assert torch.allclose(counts[:3] / 4000, expected, atol=0.03)


def test_per_row_generators_are_independent_of_batch_layout():
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0)
    seeds = [derive_seed(7, i) for i in range(3)]
    batched, _ = sample_next(logits, params, [torch.Generator().manual_seed(s) for s in seeds])
    alone = [
        sample_next(logits[i : i + 1], params, [torch.Generator().manual_seed(seeds[i])])[0].item() for i in range(3)
    ]
    assert batched.tolist() == alone
    with pytest.raises(ValueError, match="Generator"):
        sample_next(logits, params, None)


def test_derive_seed_is_deterministic_and_spread():
    assert derive_seed(3, 5) == derive_seed(3, 5)
    seeds = {derive_seed(s, i) for s in range(10) for i in range(100)}
    assert len(seeds) == 1000
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"temperature": -0.1}, "--rollout-temperature"),
        ({"temperature": float("nan")}, "--rollout-temperature"),
        ({"top_p": 0.0}, "--rollout-top-p"),
        ({"top_p": 1.5}, "--rollout-top-p"),
        ({"top_k": -2}, "--rollout-top-k"),
        ({"max_new_tokens": 0}, "--rollout-max-response-len"),
        ({"stop_token_ids": (3, -1)}, "--rollout-stop-token-ids"),
    ],
)
def test_validate_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        SamplingParams(**kwargs).validate()
    SamplingParams().validate()


def test_inverse_cdf_sample_by_hand():
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3], [0.0, 0.0, 1.0, 0.0]])
    # cdf row 0: 0.2, 0.2, 0.7, 1.0 -> u*1 in [0, .2) -> 0, [.2, .7) -> 2 (never the zero-mass token 1), [.7, 1) -> 3
    for u, expected in [(0.0, 0), (0.1999, 0), (0.2001, 2), (0.6999, 2), (0.7001, 3), (0.9999, 3)]:
        assert inverse_cdf_sample(probs, torch.tensor([u, u])).tolist() == [expected, 2]
    # unnormalised rows are scaled by their total
    assert inverse_cdf_sample(probs * 4, torch.tensor([0.5, 0.0])).tolist() == [2, 2]
