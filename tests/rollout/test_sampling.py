"""Sampling params and the pure logits -> token / log-prob functions, against hand-computed references."""
import math

import pytest
import torch

from slime_sparse.rollout.sampling import (
    SamplingParams,
    apply_top_k,
    apply_top_p,
    counter_stream,
    counter_stream_reference,
    derive_seed,
    gumbel_noise,
    gumbel_reference,
    sample_tokens,
    sampler_logprobs,
)


def keys_and_counters(keys, counters):
    return torch.tensor(keys, dtype=torch.int64), torch.tensor(counters, dtype=torch.int64)


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
    tokens, logp = sample_tokens(logits, params, *keys_and_counters([3], [0]))
    assert tokens.tolist() == [0]
    expected = 2.0 / 0.7 - math.log(sum(math.exp(x / 0.7) for x in [2.0, 1.0, 0.5, -1.0]))
    assert logp.item() == pytest.approx(expected, abs=1e-6)  # not 0.0 (= log of the truncated distribution)


def test_greedy_uses_untempered_softmax():
    logits = torch.tensor([[0.1, 3.0, 1.0], [2.0, -1.0, 2.5]])
    tokens, logp = sample_tokens(logits, SamplingParams(temperature=0.0))
    assert tokens.tolist() == [1, 2]
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(logp, torch.stack([ref[0, 1], ref[1, 2]]))
    assert torch.allclose(sampler_logprobs(logits, 0.0), ref)


def test_sampling_frequencies_follow_truncated_distribution():
    logits = torch.tensor([[1.0, 0.0, -0.5, -3.0]]).expand(4000, -1)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    # one sample's stream over 4000 tokens, and 4000 samples' first tokens: both follow the distribution
    for keys, counters in [([derive_seed(1, 0)] * 4000, list(range(4000))), ([derive_seed(1, i) for i in range(4000)],
                                                                              [0] * 4000)]:
        tok, _ = sample_tokens(logits, params, *keys_and_counters(keys, counters))
        counts = torch.bincount(tok, minlength=4).float()
        p = torch.softmax(logits[0], -1)  # [0.61, 0.22, 0.14, 0.03]: mass before token 3 is 0.97 >= 0.9 -> dropped
        expected = p[:3] / p[:3].sum()
        assert counts[3] == 0
        assert torch.allclose(counts[:3] / 4000, expected, atol=0.03)


def test_draws_depend_only_on_key_and_counter():
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0)
    keys, counters = keys_and_counters([derive_seed(7, i) for i in range(3)], [0, 5, 9])
    batched, _ = sample_tokens(logits, params, keys, counters)
    alone = [sample_tokens(logits[i : i + 1], params, keys[i : i + 1], counters[i : i + 1])[0].item() for i in range(3)]
    assert batched.tolist() == alone
    reordered, _ = sample_tokens(logits[[2, 0, 1]], params, keys[[2, 0, 1]], counters[[2, 0, 1]])
    assert reordered.tolist() == [alone[2], alone[0], alone[1]]
    with pytest.raises(ValueError, match="stream key"):
        sample_tokens(logits, params)


def test_counter_stream_and_noise_equal_their_integer_references():
    keys = [derive_seed(s, i) for s in range(3) for i in range(4)] + [0, 1, 2**63 - 1]
    counters = [0, 1, 2, 3, 7, 100, 2**20, 2**40, 5, 6, 8, 9, 0, 0, 12345]
    streams = counter_stream(*keys_and_counters(keys, counters))
    # int64 wraps like uint64: the same bits as the unsigned reference
    assert [s % 2**64 for s in streams.tolist()] == [counter_stream_reference(k, c) for k, c in zip(keys, counters)]
    noise = gumbel_noise(streams, 300)
    assert noise.dtype == torch.float32 and noise.shape == (15, 300)
    ref = torch.tensor([[gumbel_reference(s % 2**64, v) for v in range(300)] for s in streams.tolist()], dtype=torch.float64)
    assert torch.allclose(noise.double(), ref, rtol=1e-5, atol=1e-5)


def test_gumbel_noise_is_standard_gumbel_and_uncorrelated():
    streams = counter_stream(torch.full((40,), derive_seed(0, 0)), torch.arange(40))
    g = gumbel_noise(streams, 5000).double()  # 200k draws
    assert torch.isfinite(g).all()
    euler = 0.5772156649
    assert abs(float(g.mean()) - euler) < 0.01 and abs(float(g.var()) - math.pi ** 2 / 6) < 0.03
    # its CDF exp(-exp(-x)) at a few points
    for x in (-1.0, 0.0, 1.0, 3.0):
        assert abs(float((g <= x).double().mean()) - math.exp(-math.exp(-x))) < 0.005
    # neighbouring vocabulary ids, neighbouring counters and neighbouring keys are not correlated
    other_key = gumbel_noise(counter_stream(torch.full((40,), derive_seed(0, 1)), torch.arange(40)), 5000).double()
    for a, b in ((g[:, :-1], g[:, 1:]), (g[:-1], g[1:]), (g, other_key)):
        assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 0.01


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
