"""The Triton kernels of the decode step (#43 item 3), run on CPU under Triton's interpreter (TRITON_INTERPRET=1) and on
a GPU when there is one: the split-KV decode attention that reads each row's length (`triton_attention.py`) and the
one-pass Gumbel sampler (`rollout/sampling_kernel.py`).

The sampler kernel draws the torch path's tokens (the same noise bits; the path the chi-square tests check) and
records its log-probs to 1e-5 (float32 rounding of a log-sum-exp over 2,000 logits of size ~20), for every truncation setting and a vocabulary of several blocks.

The attention kernel:

- exact against dense attention (SDPA over a mask of the row's first `length` slots) in fp32, and to half-precision
  rounding in fp16: grouped and ungrouped heads, head dims that are and are not powers of two, ragged lengths (1, the
  whole span, and between), spans of one and of many splits;
- a slot at or past a row's length is never read: NaN written there changes nothing;
- the engine with decode_attention="triton" samples the tokens of the SDPA engine (slow: interpreted kernels).
The interpreter's tl.dot is wrong for bfloat16 inputs (a Triton interpreter bug: a bf16 x bf16 dot of 16 x 16 ones
gives 1e10), so bf16 is checked on the GPU only. Triton reads TRITON_INTERPRET when it is imported (its own library
functions are decorated then), so on CPU these tests run in a child process started with it set
(`test_under_the_interpreter`); in this process they are skipped.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton", reason="Triton is not installed: the kernel is checked where it is (GPU image)")

from slime_sparse.rollout import sampling_kernel  # noqa: E402
from slime_sparse.rollout.embedded import triton_attention  # noqa: E402
from slime_sparse.rollout.sampling import SamplingParams, derive_seed, sample_tokens  # noqa: E402

CUDA = torch.cuda.is_available()
HERE = not CUDA and os.environ.get("TRITON_INTERPRET") != "1"  # the parent process on CPU: the child runs the tests
in_child = pytest.mark.skipif(HERE, reason="run under TRITON_INTERPRET=1 by test_under_the_interpreter")


def run_child(marker: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, "-k",
                           "not under_the_interpreter", __file__],
                          env=env, capture_output=True, text=True, cwd=Path(__file__).parents[3], timeout=1200)
    assert done.returncode == 0 and " passed" in done.stdout and "skipped" not in done.stdout, \
        done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.skipif(not HERE, reason="this process runs the kernel tests itself")
def test_under_the_interpreter():
    run_child("not slow")


@pytest.mark.slow
@pytest.mark.skipif(not HERE, reason="this process runs the kernel tests itself")
def test_engine_under_the_interpreter():
    run_child("slow")


@pytest.fixture(scope="module")
def kernels():
    return triton_attention.build()


DEVICE = "cuda" if CUDA else "cpu"
CASES = [  # rows, query heads, kv heads, span, head dim
    (3, 4, 2, 100, 16),
    (3, 12, 2, 520, 32),  # Qwen2.5-1.5B's grouping (6 query heads per KV head), 3 splits
    (2, 6, 6, 300, 24),  # no grouping, a head dim that is not a power of two
    (2, 9, 3, 64, 8),
]


def dense(q, k, v, lengths, scale):
    n, hq, d = q.shape
    hkv, span = k.shape[1], k.shape[2]
    mask = (torch.arange(span, device=q.device)[None] < lengths[:, None])[:, None, None]
    return F.scaled_dot_product_attention(q.double().view(n, hkv, hq // hkv, d), k.double(), v.double(),
                                          attn_mask=mask, scale=scale).view(n, hq, d)


FAST = ((3, 12, 2, 300, 32), torch.float32)  # the default run's case; the rest are slow (interpreted kernels)


@in_child
@pytest.mark.parametrize("case, dtype", [FAST] + [pytest.param(c, dt, marks=pytest.mark.slow) for dt, cases in
                                                  ((torch.float32, CASES), (torch.float16, CASES[:2])) for c in cases],
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x)[6:])
def test_kernel_equals_dense_attention(kernels, case, dtype):
    n, hq, hkv, span, d = case
    gen = torch.Generator().manual_seed(sum(case))
    q = torch.randn(n, hq, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(n, hkv, span + 5, d, generator=gen).to(DEVICE, dtype)[:, :, :span]  # a view, as the cache's
    v = torch.randn(n, hkv, span + 5, d, generator=gen).to(DEVICE, dtype)[:, :, :span]
    lengths = torch.randint(1, span + 1, (n,), generator=gen)
    lengths[0], lengths[-1] = span, 1
    lengths = lengths.to(DEVICE, torch.int32)
    out = triton_attention.decode_attention_lengths(q, k, v, lengths, d ** -0.5, kernels)
    assert out.dtype == dtype and out.shape == (n, hq, d)
    tol = 2e-6 if dtype == torch.float32 else 2e-3
    assert torch.allclose(out.double(), dense(q, k, v, lengths, d ** -0.5), atol=tol, rtol=0)


@in_child
def test_slots_past_the_length_are_never_read(kernels):
    n, hq, hkv, span, d = 3, 4, 2, 270, 16
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape, generator=gen).to(DEVICE) for shape in ((n, hq, d), (n, hkv, span, d),
                                                                           (n, hkv, span, d)))
    lengths = torch.tensor([5, 270, 129], dtype=torch.int32, device=DEVICE)
    clean = triton_attention.decode_attention_lengths(q, k, v, lengths, 0.25, kernels)
    for row, length in enumerate(lengths.tolist()):
        k[row, :, length:] = float("nan")
        v[row, :, length:] = float("nan")
    assert torch.equal(triton_attention.decode_attention_lengths(q, k, v, lengths, 0.25, kernels), clean)


@pytest.fixture(scope="module")
def sampler():
    return sampling_kernel.build()


@in_child
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_k=100, top_p=0.95)] + [
    pytest.param(p, marks=pytest.mark.slow) for p in (SamplingParams(temperature=1.0),
                                                      SamplingParams(temperature=0.6, top_k=40),
                                                      SamplingParams(temperature=1.3, top_p=0.7))],
                         ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_sampler_kernel_draws_the_torch_paths_tokens(sampler, params):
    gen = torch.Generator().manual_seed(3)
    n, vocab = 24, 2 * sampling_kernel.BLOCK_V + 37  # three blocks, the last one partial
    logits = (torch.randn(n, vocab, generator=gen) * 3).to(DEVICE)
    logits[0, 5] = 40.0  # a row whose draw is nearly certain
    keys = torch.tensor([derive_seed(9, i) for i in range(n)], device=DEVICE)
    counters = torch.arange(n, device=DEVICE) * 7
    want, want_logp = sample_tokens(logits, params, keys, counters)
    got, got_logp = sample_tokens(logits, params, keys, counters, kernel=sampler)
    assert got.dtype == torch.int64 and got_logp.dtype == torch.float32
    assert torch.equal(got, want) and got[0] == 5
    assert torch.allclose(got_logp, want_logp, atol=1e-5, rtol=0)


def test_split_count_depends_on_the_span_only():
    assert [triton_attention.num_splits(s) for s in (1, 256, 257, 4096, 10**6)] == [1, 1, 2, 16, 16]


@pytest.mark.slow
@in_child
def test_engine_with_the_kernels_samples_the_torch_engines_tokens(monkeypatch):
    """End to end through the engine (dense and R-KV): the attention kernel reads the cache's fills as lengths, the
    sampler kernel draws inside the step (both through their custom ops, as on CUDA), eagerly and compiled by
    inductor (the ops opaque to it)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from slime_sparse.kv import KVCompressConfig
    from slime_sparse.rollout import SamplingParams
    from slime_sparse.rollout.embedded import EmbeddedEngine

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128)).eval().to(DEVICE)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 3, 9, 40], [11, 2], [7, 7, 8, 1, 60, 61, 62, 3, 4]]
    for kv in (KVCompressConfig(), KVCompressConfig(method="rkv", budget=8, buffer=4, window=3)):
        torch_path = EmbeddedEngine(model, kv, device=DEVICE, decode_attention="sdpa", step_mode="eager")
        reference = torch_path.generate(prompts, params, seed=1)
        monkeypatch.setattr(sampling_kernel, "_KERNEL", sampling_kernel.build())
        monkeypatch.setattr(sampling_kernel, "enabled", lambda logits: True)  # what CUDA does once checked
        for mode in ("eager", "compile"):
            torch._dynamo.reset()
            kernels = EmbeddedEngine(model, kv, device=DEVICE, decode_attention="triton", step_mode=mode)
            for x, y in zip(kernels.generate(prompts, params, seed=1), reference):
                assert x.response_ids == y.response_ids, mode
                assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
        monkeypatch.undo()
