"""The fused R-KV near-duplicate search (kv/kernels/rkv.py) against the PyTorch path it replaces, on CPU under Triton's
interpreter (conftest sets TRITON_INTERPRET=1 before triton is imported; the same checks run on CUDA in
tests/gpu/test_compaction.py). Small shapes: the interpreter runs every program in numpy."""
from __future__ import annotations

import os

import pytest
import torch

from slime_sparse.kv import KVCompressConfig, choose_slots
from slime_sparse.kv.methods.rkv import (COSINE_EPS, KERNEL_ENV, newest_duplicate, redundancy_kernel,
                                         rkv_redundancy)

triton = pytest.importorskip("triton", reason="the `test` extra installs triton")
kernels = pytest.importorskip("slime_sparse.kv.kernels.rkv")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and not kernels.interpreting(),
                                reason="triton was imported before TRITON_INTERPRET=1 was set")


def planted_keys(n: int, d: int, entries: int = 3, heads: int = 2, seed: int = 0) -> torch.Tensor:
    """Random keys with near-duplicates planted at several distances (some older copies, some newer)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(entries, heads, n, d, generator=g)
    for src, dst in ((1, n - 3), (2, n // 2), (n // 3, n // 3 + 1), (5, 9)):
        if max(src, dst) < n:
            keys[:, :, dst] = keys[:, :, src] + 0.2 * torch.randn(entries, heads, d, generator=g)
    return keys


def reference(unit: torch.Tensor, threshold: float, search: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """j*(i) and S[i, j*(i)] from the materialised similarity, as the PyTorch path computes them."""
    s = unit.to(search) if search != torch.float32 else unit
    sim = s @ s.transpose(-1, -2)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    newest = newest_duplicate(sim, threshold)
    value = (unit * unit.gather(1, newest[..., None].expand(-1, -1, unit.shape[-1]))).sum(-1)
    return newest, value.masked_fill(newest == torch.arange(unit.shape[1]), 0.0)


@pytest.mark.parametrize("n,d,dtype", [(16, 16, torch.float32), (37, 24, torch.float32), (70, 16, torch.bfloat16),
                                       (37, 16, torch.float16)])
def test_newest_near_duplicate_and_its_similarity_equal_the_reference(n, d, dtype):
    """n not a multiple of the blocks, d padded to 16; half keys searched in their dtype (the threshold and the
    similarities rounded to it as torch rounds them)."""
    keys = planted_keys(n, d).to(dtype)
    unit = keys.float()
    unit = (unit / (unit.norm(dim=-1, keepdim=True) + COSINE_EPS)).reshape(-1, n, d)
    for threshold in (0.5, 0.3):
        want_newest, want_value = reference(unit, threshold, dtype)
        newest, value = kernels.newest_and_value(unit, threshold, dtype)
        assert torch.equal(newest.long(), want_newest)
        assert (want_newest > 0).float().mean() > 0.05  # near-duplicates were found, not only the fallback
        torch.testing.assert_close(value, want_value, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_redundancy_and_selection_equal_the_pytorch_path_with_gqa(dtype):
    """R-KV's scores through the kernel equal the PyTorch path's to fp32 rounding, and so do the kept slots (GQA: 4
    query heads per KV head; the same scores tie nowhere here)."""
    n, d = 45, 16
    keys = planted_keys(n, d, entries=2, heads=2, seed=1).to(dtype)
    queries = torch.randn(2, 8, 4, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    torch.testing.assert_close(rkv_redundancy(keys, 0.5, kernel="triton"), rkv_redundancy(keys, 0.5, kernel="torch"),
                               rtol=1e-6, atol=1e-8)
    kv = KVCompressConfig(method="rkv", budget=24, buffer=8, window=4, kernel_size=3)
    scores = {}
    for kernel in ("torch", "triton"):
        os.environ[KERNEL_ENV] = kernel
        try:
            scores[kernel] = kv.scorer.score(keys, queries)
        finally:
            del os.environ[KERNEL_ENV]
    torch.testing.assert_close(scores["triton"], scores["torch"], rtol=1e-5, atol=1e-7)
    assert torch.equal(choose_slots(kv, scores["triton"][None], [24]), choose_slots(kv, scores["torch"][None], [24]))


def test_threshold_rounds_as_torch_compares():
    """`sim > t` on a half tensor rounds t to the tensor's dtype: the kernel's threshold is that value."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for t in torch.rand(200, generator=g).tolist() + [0.5, 0.699, 0.7]:
            rounded = kernels.rounded_threshold(t, dtype)
            assert rounded == torch.tensor(t, dtype=dtype).item()
    sims = torch.tensor([0.69921875], dtype=torch.bfloat16)  # torch: not > 0.699 (0.699 rounds to this very value)
    assert not bool(sims > 0.699) and not sims.item() > kernels.rounded_threshold(0.699, torch.bfloat16)


def test_the_kernel_choice_is_one_env_variable(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    assert redundancy_kernel(torch.device("cpu")) == "torch"  # auto: Triton on CUDA only
    monkeypatch.setenv(KERNEL_ENV, "triton")
    assert redundancy_kernel(torch.device("cpu")) == "triton"
    monkeypatch.setenv(KERNEL_ENV, "cuda")
    with pytest.raises(ValueError, match=KERNEL_ENV):
        redundancy_kernel(torch.device("cpu"))


def test_engine_through_the_kernel_draws_the_same_tokens_and_evictions(monkeypatch):
    """A whole generate() with R-KV compacting through the kernel: the same tokens and keep bits as the PyTorch path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from slime_sparse.rollout import SamplingParams
    from slime_sparse.rollout.embedded import EmbeddedEngine

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    kv = KVCompressConfig(method="rkv", budget=12, buffer=4, window=3, kernel_size=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12]]
    runs = {}
    for kernel in ("torch", "triton"):
        monkeypatch.setenv(KERNEL_ENV, kernel)
        out = EmbeddedEngine(model, kv, max_batch_size=2).generate(prompts, params, seed=5)
        runs[kernel] = [(o.response_ids, o.evictions.keep_bits.tolist()) for o in out]
    assert runs["triton"] == runs["torch"]
