"""The one-pass Gumbel-max sampler (#43) draws from the distribution the inverse-CDF sampler it replaced drew from.

Not a fixed seed's tokens (every token changed with the sampler) but the law: for each setting (T = 1, T != 1 with
top-k, with top-p, with both), tens of thousands of draws of the new sampler and of the old one (kept here as the
reference: fp64 cumulative sum + searchsorted over one counter-based uniform per token) go into a two-sample
chi-square test of homogeneity, and the new draws into a goodness-of-fit test against the exact truncated softmax.
A sampler with the temperature applied twice fails the same tests (they have the power to see a wrong law).
"""
import pytest
import torch

from slime_sparse.rollout.sampling import SamplingParams, derive_seed, sample_tokens, sampler_logprobs, truncate

N = 30000  # draws per sampler and setting
ALPHA = 1e-4  # fixed seeds: a p-value under this is a real difference, not bad luck (~1e-4 chance per test)
_MASK64 = (1 << 64) - 1


def old_uniforms(keys: list[int], counters: list[int]) -> torch.Tensor:
    """The replaced sampler's uniform per (key, counter): splitmix64 -> 53 bits, in Python integers."""
    out = []
    for key, counter in zip(keys, counters):
        z = (key + (counter + 1) * 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(((z ^ (z >> 31)) >> 11) / float(1 << 53))
    return torch.tensor(out, dtype=torch.float64)


def old_sample(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> torch.Tensor:
    """The replaced sampler: softmax of the truncated tempered logits, inverse CDF accumulated in float64."""
    probs = torch.softmax(truncate(logits.float() / params.temperature, params), dim=-1)
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    target = uniforms[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def chi2_p(stat: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (regularised upper incomplete gamma)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def homogeneity_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample chi-square test on category counts (categories with few expected draws pooled)."""
    total = a + b
    keep = total >= 10
    a = torch.cat([a[keep], a[~keep].sum()[None]]) if (~keep).any() else a[keep]
    b = torch.cat([b[keep], b[~keep].sum()[None]]) if (~keep).any() else b[keep]
    total, na, nb = a + b, a.sum(), b.sum()
    nonzero = total > 0
    ea, eb = total * na / (na + nb), total * nb / (na + nb)
    stat = (((a - ea) ** 2 / ea) + ((b - eb) ** 2 / eb))[nonzero].sum()
    return chi2_p(float(stat), int(nonzero.sum()) - 1)


def goodness_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of counts to probs; 0 when a token of probability 0 was drawn."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    keep = expected >= 10
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    live = exp > 0
    stat = ((obs - exp) ** 2 / exp)[live].sum()
    return chi2_p(float(stat), int(live.sum()) - 1)


LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.7, 0.3, 0.0, -0.4, -1.0, -1.7, -2.5, -4.0, -7.0], dtype=torch.float64)
SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
            SamplingParams(temperature=1.6, top_p=0.8), SamplingParams(temperature=0.5, top_k=8, top_p=0.9)]


def draws(params: SamplingParams, sampler) -> torch.Tensor:
    """Token counts of N draws: half from N/2 samples' first tokens, half from one sample's N/2 successive tokens
    (both ways a sample's stream is used)."""
    half = N // 2
    keys = [derive_seed(11, i) for i in range(half)] + [derive_seed(12, 0)] * half
    counters = [1] * half + list(range(1, half + 1))
    logits = LOGITS.float().expand(N, -1)
    tokens = sampler(logits, params, torch.tensor(keys), torch.tensor(counters))
    return torch.bincount(tokens, minlength=LOGITS.numel()).double()


def new_sampler(logits, params, keys, counters):
    return sample_tokens(logits, params, keys, counters)[0]


def old_sampler(logits, params, keys, counters):
    return old_sample(logits, params, old_uniforms(keys.tolist(), counters.tolist()))


def twice_tempered(logits, params, keys, counters):
    return sample_tokens(logits / params.temperature, params, keys, counters)[0]


def exact(params: SamplingParams) -> torch.Tensor:
    return torch.softmax(truncate(LOGITS / params.temperature, params), dim=-1)


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_gumbel_sampler_draws_the_inverse_cdf_samplers_law(params):
    new, old = draws(params, new_sampler), draws(params, old_sampler)
    assert homogeneity_p(new, old) > ALPHA
    assert goodness_p(new, exact(params)) > ALPHA
    assert goodness_p(old, exact(params)) > ALPHA  # the reference itself follows the law


@pytest.mark.parametrize("params", SETTINGS[1:], ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_the_tests_see_a_wrong_law(params):
    """The temperature applied twice (a bug the old code was one line from) is rejected by both tests."""
    wrong, old = draws(params, twice_tempered), draws(params, old_sampler)
    assert homogeneity_p(wrong, old) < ALPHA
    assert goodness_p(wrong, exact(params)) < ALPHA


def test_recorded_logprob_is_the_learners_formula_bit_for_bit():
    """The sampler's log-prob is log_softmax(logits / T)[token] of the untruncated logits, as the learner computes it
    (utils.lm_head.tempered_log_softmax), exactly: same operations on the same numbers."""
    torch.manual_seed(0)
    logits = torch.randn(6, 97) * 3
    keys, counters = torch.tensor([derive_seed(1, i) for i in range(6)]), torch.arange(6)
    for params in SETTINGS + [SamplingParams(temperature=0.0)]:
        tokens, logp = sample_tokens(logits, params, keys, counters)
        expected = sampler_logprobs(logits, params.temperature).gather(-1, tokens[:, None]).squeeze(-1)
        assert torch.equal(logp, expected)
        if params.top_k > 0 or params.top_p < 1:  # drawn tokens lie in the truncated set
            allowed = torch.isfinite(truncate(logits / params.temperature, params))
            assert allowed.gather(-1, tokens[:, None]).all()
